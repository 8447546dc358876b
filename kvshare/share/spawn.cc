#include "kvshare/share/spawn.h"

#include <fcntl.h>
#include <linux/close_range.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <set>
#include <thread>

#include "kvshare/sys.h"

extern char** environ;

namespace kvshare {
namespace {

using Clock = std::chrono::steady_clock;

// What the child reports on the status pipe when a step before exec (or exec) fails.
enum class ChildStep : int { setpgid, pdeathsig, lift, stdin, stdout, stderr, inherit, close_range, exec };

struct ChildFailure {
  ChildStep step = ChildStep::exec;
  int error = 0;
  int fd = -1;  // the descriptor the step was about, or -1
};

std::string describe_step(const ChildFailure& failure) {
  switch (failure.step) {
    case ChildStep::setpgid:
      return "setpgid (a process group of its own)";
    case ChildStep::pdeathsig:
      return "prctl(PR_SET_PDEATHSIG)";
    case ChildStep::lift:
      return fmt::format("moving fd {} out of the way of the inherited numbers", failure.fd);
    case ChildStep::stdin:
      return "dup2 of /dev/null to its stdin";
    case ChildStep::stdout:
      return "dup2 to its stdout";
    case ChildStep::stderr:
      return "dup2 to its stderr";
    case ChildStep::inherit:
      return fmt::format("dup2 to inherited fd {}", failure.fd);
    case ChildStep::close_range:
      return "close_range(CLOSE_RANGE_CLOEXEC) on every other descriptor (Linux 5.11 or later)";
    case ChildStep::exec:
      return "exec";
  }
  return "an unknown step";
}

Result<std::string> resolve_program(const std::string& name) {
  if (name.empty()) return fail(EINVAL, "spawn: the command is empty");
  if (name.find('/') != std::string::npos) return name;
  const char* path = std::getenv("PATH");
  std::string_view dirs = path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
  while (!dirs.empty()) {
    const size_t colon = dirs.find(':');
    const std::string dir(dirs.substr(0, colon));
    dirs = colon == std::string_view::npos ? std::string_view{} : dirs.substr(colon + 1);
    const std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + name;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return fail(ENOENT, "spawn: program {} is not in PATH", name);
}

ExitStatus decode_wait_status(int status) {
  ExitStatus exit;
  if (WIFEXITED(status)) {
    exit.exited = true;
    exit.code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    exit.signal = WTERMSIG(status);
  }
  return exit;
}

void append_capped(std::string& text, const char* data, size_t n) {
  text.append(data, n);
  if (text.size() > kCaptureBytes) text.erase(0, text.size() - kCaptureBytes);
}

// Everything the child needs, prepared before the clone: the child shares the parent's
// memory until it execs (CLONE_VM | CLONE_VFORK) and the parent has other threads, so it
// may only make async-signal-safe calls, no allocation, and write nothing of the parent's
// but `lifted` and errno.
struct ExecPlan {
  const char* program = nullptr;
  char* const* argv = nullptr;
  char* const* envp = nullptr;
  const SpawnOptions* options = nullptr;
  pid_t parent = 0;
  int devnull = -1;
  int stdout_fd = -1;  // the capture pipe's write end, or -1
  int stderr_fd = -1;  // the capture pipe's write end or the stderr file, or -1
  int status_fd = -1;
  int floor = 3;                        // above every target number: where sources are lifted to
  int* lifted = nullptr;                // [n inherit] scratch
  const int* sorted_targets = nullptr;  // [n inherit] ascending
};

// The child's code runs on a stack ASan does not know (see clone_and_exec): uninstrumented,
// or ASan's no-return bookkeeping warns on the child's stderr before exec.
#define KVSHARE_CHILD_CODE __attribute__((no_sanitize("address")))

[[noreturn]] KVSHARE_CHILD_CODE void child_fail(int status_fd, ChildStep step, int fd) {
  const ChildFailure failure{step, errno, fd};
  (void)!::write(status_fd, &failure, sizeof failure);
  ::_exit(127);
}

[[noreturn]] KVSHARE_CHILD_CODE void exec_child(const ExecPlan& plan) {
  const SpawnOptions& options = *plan.options;
  // The status pipe first: every later failure is reported through it.
  const int status_fd = ::fcntl(plan.status_fd, F_DUPFD_CLOEXEC, plan.floor);
  if (status_fd < 0) child_fail(plan.status_fd, ChildStep::lift, plan.status_fd);
  if (::setpgid(0, 0) != 0) child_fail(status_fd, ChildStep::setpgid, -1);
  if (options.die_with_parent) {
    if (::prctl(PR_SET_PDEATHSIG, SIGTERM) != 0) child_fail(status_fd, ChildStep::pdeathsig, -1);
    // The parent may have died before the prctl: then no signal would ever come.
    if (::getppid() != plan.parent) ::_exit(127);
  }
  // Every signal is blocked (the parent blocked them around the clone). A handler of the
  // parent's must not run here, on memory the parent shares: back to the default before
  // anything is unblocked. serve blocks SIGTERM/SIGINT for its signal thread and ignores
  // SIGPIPE; both would survive exec and change how the child dies.
  struct sigaction default_action {};
  default_action.sa_handler = SIG_DFL;
  for (int sig = 1; sig < NSIG; ++sig) {
    struct sigaction current {};
    if (::sigaction(sig, nullptr, &current) != 0) continue;  // 32/33: glibc's own, refused
    if (sig == SIGPIPE || (current.sa_handler != SIG_DFL && current.sa_handler != SIG_IGN))
      ::sigaction(sig, &default_action, nullptr);
  }
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);

  // Lift every source above the target numbers first, so a dup2 onto a target can never
  // clobber a source that happens to sit there.
  auto lift = [&](int fd) KVSHARE_CHILD_CODE {
    if (fd < 0) return -1;
    const int high = ::fcntl(fd, F_DUPFD_CLOEXEC, plan.floor);
    if (high < 0) child_fail(status_fd, ChildStep::lift, fd);
    return high;
  };
  const size_t n = options.inherit_fds.size();
  for (size_t i = 0; i < n; ++i) plan.lifted[i] = lift(options.inherit_fds[i].first);
  const int devnull = lift(plan.devnull), out = lift(plan.stdout_fd), err = lift(plan.stderr_fd);
  // dup2 clears close-on-exec on the new number: these are exactly what survives exec.
  if (::dup2(devnull, STDIN_FILENO) < 0) child_fail(status_fd, ChildStep::stdin, devnull);
  if (err >= 0 && ::dup2(err, STDERR_FILENO) < 0) child_fail(status_fd, ChildStep::stderr, err);
  if (out >= 0) {
    if (::dup2(out, STDOUT_FILENO) < 0) child_fail(status_fd, ChildStep::stdout, out);
  } else if (options.stdout_to_stderr) {
    if (::dup2(STDERR_FILENO, STDOUT_FILENO) < 0) child_fail(status_fd, ChildStep::stdout, STDERR_FILENO);
  }
  for (size_t i = 0; i < n; ++i) {
    const int target = options.inherit_fds[i].second;
    if (::dup2(plan.lifted[i], target) != target) child_fail(status_fd, ChildStep::inherit, target);
  }
  // Everything but 0-2 and the targets closes at exec, even what a library opened without
  // O_CLOEXEC (cpp-httplib's accepted client sockets, for one).
  unsigned int from = 3;
  for (size_t i = 0; i <= n; ++i) {
    const unsigned int to = i < n ? static_cast<unsigned int>(plan.sorted_targets[i]) : UINT_MAX;
    if (to > from && ::syscall(SYS_close_range, from, to == UINT_MAX ? UINT_MAX : to - 1, CLOSE_RANGE_CLOEXEC) != 0)
      child_fail(status_fd, ChildStep::close_range, -1);
    if (i < n) from = to + 1;
  }
  ::execve(plan.program, plan.argv, plan.envp);
  child_fail(status_fd, ChildStep::exec, -1);
}

KVSHARE_CHILD_CODE int clone_entry(void* plan) { exec_child(*static_cast<const ExecPlan*>(plan)); }

// The child runs on a stack of its own in the parent's address space until it execs: no
// copy of the parent's page tables and no copy-on-write faults in either process: a fork
// from kvshare-serve (67 threads) was slow to reach exec on a VM with shadow page tables
// (docs/hybrid.md, "What it costs", has before and after). This is what posix_spawn does,
// which cannot set a death signal or lift fds. -1 with errno when the stack cannot be
// mapped or the clone fails.
constexpr size_t kChildStack = 256 * 1024;

pid_t clone_and_exec(ExecPlan& plan) {
  void* stack = ::mmap(nullptr, kChildStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
  if (stack == MAP_FAILED) return -1;
  sigset_t all, old;
  sigfillset(&all);
  ::pthread_sigmask(SIG_BLOCK, &all, &old);
  // CLONE_VFORK: this thread waits until the child has exec'd or exited, so the plan and
  // the stack outlive every use.
  const pid_t pid =
      ::clone(clone_entry, static_cast<char*>(stack) + kChildStack, CLONE_VM | CLONE_VFORK | SIGCHLD, &plan);
  const int clone_errno = errno;
  ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
  ::munmap(stack, kChildStack);
  errno = clone_errno;
  return pid;
}

}  // namespace

std::string ExitStatus::describe() const {
  if (exited) return fmt::format("exit code {}", code);
  return fmt::format("signal {} ({})", signal, ::strsignal(signal));
}

std::vector<std::pair<int, int>> inherit_in_order(std::span<const int> fds) {
  std::vector<std::pair<int, int>> pairs;
  for (size_t i = 0; i < fds.size(); ++i) pairs.emplace_back(fds[i], kFirstInheritedFd + static_cast<int>(i));
  return pairs;
}

std::string inherited_fd_list(size_t n_fds) {
  std::string text;
  for (size_t i = 0; i < n_fds; ++i) text += (i ? "," : "") + std::to_string(kFirstInheritedFd + i);
  return text;
}

std::string Finished::last_stdout_line() const {
  size_t end = out.size();
  while (end > 0) {
    while (end > 0 && (out[end - 1] == '\n' || out[end - 1] == '\r')) --end;
    const size_t start = out.rfind('\n', end == 0 ? 0 : end - 1);
    const size_t begin = start == std::string::npos ? 0 : start + 1;
    if (end > begin) return out.substr(begin, end - begin);
    if (begin == 0) break;
    end = begin;
  }
  return {};
}

Result<ChildProcess> ChildProcess::spawn(const std::vector<std::string>& argv, const SpawnOptions& options) {
  if (argv.empty()) return fail(EINVAL, "spawn: the command is empty");
  if (options.inherit_fds.size() > kMaxInheritedFds)
    return fail(EINVAL, "spawn {}: {} descriptors to pass, the limit is {}", argv[0], options.inherit_fds.size(),
                kMaxInheritedFds);
  std::vector<int> targets;
  for (const auto& [fd, target] : options.inherit_fds) {
    if (fd < 0)
      return fail(EBADF, "spawn {}: inherited descriptor {} (for number {}) is not open", argv[0], fd, target);
    if (target < kFirstInheritedFd)
      return fail(EINVAL, "spawn {}: an inherited descriptor cannot take number {} (0-2 are stdin, stdout, stderr)",
                  argv[0], target);
    targets.push_back(target);
  }
  std::sort(targets.begin(), targets.end());
  if (std::adjacent_find(targets.begin(), targets.end()) != targets.end())
    return fail(EINVAL, "spawn {}: two inherited descriptors want number {}", argv[0],
                *std::adjacent_find(targets.begin(), targets.end()));
  auto program = resolve_program(argv[0]);
  if (!program) return fail(program.error());

  std::vector<char*> child_argv;
  for (const auto& arg : argv) child_argv.push_back(const_cast<char*>(arg.c_str()));
  child_argv.push_back(nullptr);
  // Our environment with options.env set on top (a NAME in both takes the new value).
  auto overridden = [&](std::string_view entry) {
    const std::string_view name = entry.substr(0, entry.find('=') + 1);  // "NAME="
    return std::any_of(options.env.begin(), options.env.end(),
                       [&](const std::string& set) { return std::string_view(set).starts_with(name); });
  };
  std::vector<char*> child_env;
  for (char** entry = environ; *entry != nullptr; ++entry)
    if (!overridden(*entry)) child_env.push_back(*entry);
  for (const auto& set : options.env) child_env.push_back(const_cast<char*>(set.c_str()));
  child_env.push_back(nullptr);
  std::vector<int> lifted(options.inherit_fds.size());

  Fd devnull(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (!devnull) return fail(errno, "spawn {}: open /dev/null for its stdin", *program);
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return fail(errno, "spawn {}: status pipe", *program);
  Fd status_r(pipe_fds[0]), status_w(pipe_fds[1]);
  Fd out_r, out_w, err_r, err_w;
  if (options.capture_stdout) {
    if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return fail(errno, "spawn {}: stdout pipe", *program);
    out_r.reset(pipe_fds[0]);
    out_w.reset(pipe_fds[1]);
  }
  if (options.capture_stderr) {
    if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return fail(errno, "spawn {}: stderr pipe", *program);
    err_r.reset(pipe_fds[0]);
    err_w.reset(pipe_fds[1]);
  } else if (!options.stderr_path.empty()) {
    err_w.reset(::open(options.stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    if (!err_w) return fail(errno, "spawn {}: opening {} for its stderr", *program, options.stderr_path);
  }

  ExecPlan plan;
  plan.program = program->c_str();
  plan.argv = child_argv.data();
  plan.envp = child_env.data();
  plan.options = &options;
  plan.parent = ::getpid();
  plan.devnull = devnull.get();
  plan.stdout_fd = out_w.get();
  plan.stderr_fd = err_w.get();
  plan.status_fd = status_w.get();
  plan.floor = std::max(kFirstInheritedFd, targets.empty() ? 0 : targets.back() + 1);
  plan.lifted = lifted.data();
  plan.sorted_targets = targets.data();

  const auto started = Clock::now();
  const pid_t pid = clone_and_exec(plan);
  if (pid < 0) return fail(errno, "spawn {}: clone (or mapping its {} KiB stack)", *program, kChildStack / 1024);
  // Also from the parent: whichever runs first, the group exists before anyone signals it.
  // (EACCES once the child has exec'd: it made the group itself by then.)
  ::setpgid(pid, pid);
  status_w.reset();
  out_w.reset();
  err_w.reset();

  ChildProcess child;
  child.pid_ = pid;
  child.program_ = *program;
  child.started_ = started;
  child.stdout_ = std::move(out_r);
  child.stderr_ = std::move(err_r);
  ChildFailure failure;
  ssize_t got;
  do got = ::read(status_r.get(), &failure, sizeof failure);
  while (got < 0 && errno == EINTR);
  if (got == static_cast<ssize_t>(sizeof failure)) {
    child.kill_group();  // it never exec'd: nothing but itself is in its group
    return fail(failure.error, "spawn {}: {} failed in the child", *program, describe_step(failure));
  }
  // Without a pidfd (Linux before 5.3) waiting falls back to polling every 10 ms.
  child.pidfd_.reset(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
  return child;
}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)),
      program_(std::move(other.program_)),
      pidfd_(std::move(other.pidfd_)),
      stdout_(std::move(other.stdout_)),
      stderr_(std::move(other.stderr_)),
      out_(std::move(other.out_)),
      err_(std::move(other.err_)),
      status_(std::move(other.status_)),
      started_(other.started_),
      elapsed_ms_(other.elapsed_ms_) {}

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    kill_group();
    pid_ = std::exchange(other.pid_, -1);
    program_ = std::move(other.program_);
    pidfd_ = std::move(other.pidfd_);
    stdout_ = std::move(other.stdout_);
    stderr_ = std::move(other.stderr_);
    out_ = std::move(other.out_);
    err_ = std::move(other.err_);
    status_ = std::move(other.status_);
    started_ = other.started_;
    elapsed_ms_ = other.elapsed_ms_;
  }
  return *this;
}

ChildProcess::~ChildProcess() { kill_group(); }

bool ChildProcess::reap(bool block) noexcept {
  if (status_) return true;
  if (pid_ < 0) return false;
  // Look without reaping: as long as the leader is an unreaped zombie its process group id
  // cannot be reused, so the group signal below can reach only what the child left behind.
  siginfo_t info{};
  int rc;
  do rc = ::waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOWAIT | (block ? 0 : WNOHANG));
  while (rc < 0 && errno == EINTR);
  if (rc < 0) {
    // ECHILD: someone else reaped it (nothing in kvshare does); never signal the group now.
    status_ = ExitStatus{};
    elapsed_ms_ = std::chrono::duration<double, std::milli>(Clock::now() - started_).count();
    pidfd_.reset();
    return true;
  }
  if (info.si_pid == 0) return false;  // WNOHANG: still running
  sys::ops().kill(-pid_, SIGKILL);
  int status = 0;
  pid_t got;
  do got = sys::ops().waitpid(pid_, &status, 0);
  while (got < 0 && errno == EINTR);
  status_ = got == pid_ ? decode_wait_status(status) : ExitStatus{};
  elapsed_ms_ = std::chrono::duration<double, std::milli>(Clock::now() - started_).count();
  pidfd_.reset();
  return true;
}

void ChildProcess::drain(int timeout_ms) {
  pollfd fds[3] = {{stdout_ ? stdout_.get() : -1, POLLIN, 0},
                   {stderr_ ? stderr_.get() : -1, POLLIN, 0},
                   {!status_ && pidfd_ ? pidfd_.get() : -1, POLLIN, 0}};
  const bool waits_on_pidfd = fds[2].fd >= 0;
  // Without a pidfd nothing wakes us at the exit: poll in short steps.
  if (!waits_on_pidfd && !status_) timeout_ms = std::min(timeout_ms, 10);
  const int ready = ::poll(fds, 3, timeout_ms);
  if (ready <= 0) return;  // timeout, or EINTR: the caller loops
  char buffer[16384];
  for (int i = 0; i < 2; ++i) {
    if (fds[i].fd < 0 || fds[i].revents == 0) continue;
    Fd& pipe = i == 0 ? stdout_ : stderr_;
    const ssize_t got = ::read(pipe.get(), buffer, sizeof buffer);
    if (got > 0)
      append_capped(i == 0 ? out_ : err_, buffer, static_cast<size_t>(got));
    else if (got == 0 || (errno != EINTR && errno != EAGAIN))
      pipe.reset();  // EOF: nobody writes any more
  }
}

Finished ChildProcess::finished() const {
  Finished done;
  done.status = status_.value_or(ExitStatus{});
  done.elapsed_ms = elapsed_ms_;
  done.out = out_;
  done.err = err_;
  return done;
}

Result<Finished> ChildProcess::wait_for(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!reap(false)) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0)
      return fail(ETIMEDOUT, "{} (pid {}) still running after {} ms", program_, pid_, timeout.count());
    drain(static_cast<int>(std::min<long long>(left.count(), INT_MAX)));
  }
  // What it wrote before it ended. Its group is gone, so the pipes reach EOF unless
  // something outside the group holds them: stop at the first empty poll then.
  while (stdout_ || stderr_) {
    pollfd fds[2] = {{stdout_ ? stdout_.get() : -1, POLLIN, 0}, {stderr_ ? stderr_.get() : -1, POLLIN, 0}};
    if (::poll(fds, 2, 0) <= 0) break;
    drain(0);
  }
  stdout_.reset();
  stderr_.reset();
  return finished();
}

Finished ChildProcess::wait_or_kill(std::chrono::milliseconds timeout) {
  auto done = wait_for(timeout);
  if (done) return std::move(*done);
  kill_group();
  Finished killed = finished();
  killed.timed_out = true;
  return killed;
}

std::optional<ExitStatus> ChildProcess::poll_exit() {
  if (reap(false)) return status_;
  return std::nullopt;
}

void ChildProcess::kill_group() noexcept {
  if (pid_ < 0) return;
  if (!status_) {
    // Not reaped yet, so the group id is still this child's.
    sys::ops().kill(-pid_, SIGKILL);
    sys::ops().kill(pid_, SIGKILL);  // in case the group was never made (setpgid failed in both)
    reap(true);
  }
  stdout_.reset();
  stderr_.reset();
}

ExitStatus ChildProcess::terminate(std::chrono::milliseconds grace) noexcept {
  if (pid_ < 0) return status_.value_or(ExitStatus{});
  if (!reap(false)) {
    sys::ops().kill(-pid_, SIGTERM);
    const auto deadline = Clock::now() + grace;
    while (!reap(false) && Clock::now() < deadline) drain(10);
  }
  kill_group();
  return status_.value_or(ExitStatus{});
}

Result<Finished> run_child(const std::vector<std::string>& argv, const SpawnOptions& options,
                           std::chrono::milliseconds timeout) {
  auto child = ChildProcess::spawn(argv, options);
  if (!child) return fail(child.error());
  return child->wait_or_kill(timeout);
}

}  // namespace kvshare
