#include "kvshare/share/spawn.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "kvshare/sys.h"

extern char** environ;

namespace kvshare {
namespace {

using Clock = std::chrono::steady_clock;

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

// posix_spawn_file_actions_t and posix_spawnattr_t, destroyed on every return.
class FileActions {
 public:
  FileActions() { ::posix_spawn_file_actions_init(&actions_); }
  ~FileActions() { ::posix_spawn_file_actions_destroy(&actions_); }
  FileActions(const FileActions&) = delete;
  FileActions& operator=(const FileActions&) = delete;
  posix_spawn_file_actions_t* get() { return &actions_; }

 private:
  posix_spawn_file_actions_t actions_;
};

class SpawnAttributes {
 public:
  SpawnAttributes() { ::posix_spawnattr_init(&attributes_); }
  ~SpawnAttributes() { ::posix_spawnattr_destroy(&attributes_); }
  SpawnAttributes(const SpawnAttributes&) = delete;
  SpawnAttributes& operator=(const SpawnAttributes&) = delete;
  posix_spawnattr_t* get() { return &attributes_; }

 private:
  posix_spawnattr_t attributes_;
};

// The file actions run in order in the child, so a dup2 onto number N destroys whatever
// the child had at N. A source that sits on a number some dup2 writes (0-2 or a target)
// is therefore duplicated in this process, close-on-exec, to `floor` or above (past every
// target) before the spawn, and the copy is what the child dup2s from. `copies` owns the
// copies until the spawn has returned.
Result<int> lift_off_targets(int fd, const std::vector<int>& sorted_targets, int floor, std::vector<Fd>& copies) {
  if (fd < 0) return fd;
  if (fd > STDERR_FILENO && !std::binary_search(sorted_targets.begin(), sorted_targets.end(), fd)) return fd;
  Fd copy(::fcntl(fd, F_DUPFD_CLOEXEC, floor));
  if (!copy) return fail(errno, "moving fd {} above the inherited numbers (to {} or more)", fd, floor);
  copies.push_back(std::move(copy));
  return copies.back().get();
}

// glibc's own signals, 32 and 33 (from __SIGRTMIN up to SIGRTMIN): its posix_spawn
// (2.36, sysdeps/unix/sysv/linux/spawni.c) sets them to SIG_IGN in the child unless they
// are in the spawn-sigdefault set, and an ignored signal stays ignored after exec. sigaddset
// refuses them, so their bits are set by hand.
void add_libc_signals(sigset_t& set) {
  constexpr int kWordBits = 8 * sizeof set.__val[0];
  for (int sig = __SIGRTMIN; sig < SIGRTMIN; ++sig) set.__val[(sig - 1) / kWordBits] |= 1UL << ((sig - 1) % kWordBits);
}

// The death signal. glibc's posix_spawn cannot call prctl(PR_SET_PDEATHSIG) in the child,
// so the child execs setpriv (util-linux, essential on Debian) to set it, and setpriv execs
// a shell that checks its parent is still this process: one that died before setpriv's
// prctl sends no signal, and the child would run on as an orphan. The shell's $PPID is read
// after the prctl; exit 127 then, as for an exec that failed. Two more execs (their cost is
// in docs/hybrid.md) once per decoder or resident provider start buy one spawner, not two.
constexpr const char* kCheckParentThenExec = "[ \"$PPID\" = \"$1\" ] || exit 127; shift; exec \"$@\"";

Result<std::vector<std::string>> through_death_signal(const std::string& program,
                                                      const std::vector<std::string>& argv) {
  auto setpriv = resolve_program("setpriv");
  if (!setpriv)
    return fail(ENOENT,
                "spawn {}: a child that dies with its parent is started through setpriv (util-linux), "
                "which is not in PATH; install util-linux",
                program);
  // The shell's exec of the program cannot report back: check it can run from here.
  if (::access(program.c_str(), X_OK) != 0) return fail(errno, "spawn {}: exec", program);
  // setpriv --pdeathsig TERM -- /bin/sh -c CHECK kvshare-spawn PARENT_PID PROGRAM ARGS...
  std::vector<std::string> wrapped = {*setpriv, "--pdeathsig", "TERM", "--", "/bin/sh", "-c"};
  wrapped.insert(wrapped.end(), {kCheckParentThenExec, "kvshare-spawn", std::to_string(::getpid()), program});
  wrapped.insert(wrapped.end(), argv.begin() + 1, argv.end());
  return wrapped;
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
  rlimit open_files{};
  ::getrlimit(RLIMIT_NOFILE, &open_files);
  std::vector<int> targets;
  for (const auto& [fd, target] : options.inherit_fds) {
    // Checked here: in the child a failed dup2 comes back as a bare EBADF, naming nothing.
    if (fd < 0 || ::fcntl(fd, F_GETFD) < 0)
      return fail(EBADF, "spawn {}: inherited fd {} (for number {}) is not open", argv[0], fd, target);
    if (target < kFirstInheritedFd)
      return fail(EINVAL, "spawn {}: an inherited descriptor cannot take number {} (0-2 are stdin, stdout, stderr)",
                  argv[0], target);
    if (static_cast<rlim_t>(target) >= open_files.rlim_cur)
      return fail(EINVAL, "spawn {}: inherited number {} is past the open-file limit {} (ulimit -n)", argv[0], target,
                  open_files.rlim_cur);
    targets.push_back(target);
  }
  std::sort(targets.begin(), targets.end());
  if (std::adjacent_find(targets.begin(), targets.end()) != targets.end())
    return fail(EINVAL, "spawn {}: two inherited descriptors want number {}", argv[0],
                *std::adjacent_find(targets.begin(), targets.end()));
  auto program = resolve_program(argv[0]);
  if (!program) return fail(program.error());
  std::vector<std::string> exec_argv = argv;
  std::string exec_program = *program;
  if (options.die_with_parent) {
    auto wrapped = through_death_signal(*program, argv);
    if (!wrapped) return fail(wrapped.error());
    exec_argv = std::move(*wrapped);
    exec_program = exec_argv[0];
  }

  std::vector<char*> child_argv;
  for (const auto& arg : exec_argv) child_argv.push_back(const_cast<char*>(arg.c_str()));
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

  int pipe_fds[2];
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

  // Above every number the child's dup2s write: where sources are lifted to, and where the
  // child's closefrom starts.
  const int floor = std::max(kFirstInheritedFd, targets.empty() ? 0 : targets.back() + 1);
  std::vector<Fd> copies;
  FileActions actions;
  int rc = ::posix_spawn_file_actions_addopen(actions.get(), STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  auto dup_to = [&](int fd, int number) -> Result<void> {
    auto source = lift_off_targets(fd, targets, floor, copies);
    if (!source) return fail(source.error().with_context(fmt::format("spawn {}", *program)));
    // dup2 clears close-on-exec on the new number (also when source and number are equal,
    // glibc 2.29 on): these are exactly what survives exec.
    if (rc == 0) rc = ::posix_spawn_file_actions_adddup2(actions.get(), *source, number);
    return {};
  };
  if (err_w) {
    if (auto dup = dup_to(err_w.get(), STDERR_FILENO); !dup) return fail(dup.error());
  }
  if (out_w) {
    if (auto dup = dup_to(out_w.get(), STDOUT_FILENO); !dup) return fail(dup.error());
  } else if (options.stdout_to_stderr && rc == 0) {
    rc = ::posix_spawn_file_actions_adddup2(actions.get(), STDERR_FILENO, STDOUT_FILENO);
  }
  for (const auto& [fd, target] : options.inherit_fds)
    if (auto dup = dup_to(fd, target); !dup) return fail(dup.error());
  // Everything but 0-2 and the targets is closed, even what a library opened without
  // O_CLOEXEC (cpp-httplib's accepted client sockets, for one): each number between the
  // targets (glibc ignores one that is not open), then everything from `floor` up.
  for (int number = kFirstInheritedFd; number < floor && rc == 0; ++number)
    if (!std::binary_search(targets.begin(), targets.end(), number))
      rc = ::posix_spawn_file_actions_addclose(actions.get(), number);
  // At the open-file limit nothing can be open from `floor` up, and glibc refuses the action.
  if (rc == 0 && static_cast<rlim_t>(floor) < open_files.rlim_cur)
    rc = ::posix_spawn_file_actions_addclosefrom_np(actions.get(), floor);
  if (rc != 0) return fail(rc, "spawn {}: building its file actions", *program);

  // Its own process group, no blocked signal, SIGPIPE and glibc's signals at their default:
  // serve blocks SIGTERM and SIGINT for its signal thread and ignores SIGPIPE, and both
  // would survive exec. glibc also resets every handler of ours to the default in the child
  // before unblocking, since the child runs on our memory until it execs.
  SpawnAttributes attributes;
  sigset_t none, to_default;
  sigemptyset(&none);
  sigemptyset(&to_default);
  sigaddset(&to_default, SIGPIPE);
  add_libc_signals(to_default);
  rc = ::posix_spawnattr_setflags(attributes.get(),
                                  POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  if (rc == 0) rc = ::posix_spawnattr_setpgroup(attributes.get(), 0);
  if (rc == 0) rc = ::posix_spawnattr_setsigmask(attributes.get(), &none);
  if (rc == 0) rc = ::posix_spawnattr_setsigdefault(attributes.get(), &to_default);
  if (rc != 0) return fail(rc, "spawn {}: building its attributes", *program);

  // glibc clones with CLONE_VM | CLONE_VFORK: no copy of our page tables and no
  // copy-on-write fault afterwards, and this thread waits until the child has exec'd, so
  // the group exists before anyone can signal it. Failures of the steps before exec come
  // back as posix_spawn's result.
  const auto started = Clock::now();
  pid_t pid = -1;
  rc = ::posix_spawn(&pid, exec_program.c_str(), actions.get(), attributes.get(), child_argv.data(), child_env.data());
  if (rc != 0)
    return fail(rc,
                "spawn {}: exec (or a step before it: its process group, /dev/null on its stdin, a dup2, "
                "closing the rest) failed",
                *program);
  copies.clear();
  out_w.reset();
  err_w.reset();

  ChildProcess child;
  child.pid_ = pid;
  child.program_ = *program;
  child.started_ = started;
  child.stdout_ = std::move(out_r);
  child.stderr_ = std::move(err_r);
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
