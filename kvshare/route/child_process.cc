#include "kvshare/route/child_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <thread>

namespace kvshare::route {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kMaxCapturedBytes = 1 << 20;

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

// In the child between fork and exec: only async-signal-safe calls.
[[noreturn]] void exec_child(char* const* argv, char* const* envp, const SpawnOptions& options, int stdout_write,
                             int stderr_file, int error_write) {
  ::setpgid(0, 0);
  if (options.die_with_parent) ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  // Signals blocked by serve's signal thread must not stay blocked in the child.
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  // serve ignores SIGPIPE (a client may leave mid-reply); an ignored signal survives exec.
  struct sigaction default_action {};
  default_action.sa_handler = SIG_DFL;
  ::sigaction(SIGPIPE, &default_action, nullptr);
  if (stderr_file >= 0) ::dup2(stderr_file, STDERR_FILENO);
  if (stdout_write >= 0) ::dup2(stdout_write, STDOUT_FILENO);
  else if (options.stdout_to_stderr) ::dup2(STDERR_FILENO, STDOUT_FILENO);
  // Two passes: a target number may be another source's current number.
  int moved[64];
  const size_t n = options.inherit_fds.size() < 64 ? options.inherit_fds.size() : 64;
  for (size_t i = 0; i < n; ++i) moved[i] = ::fcntl(options.inherit_fds[i].first, F_DUPFD_CLOEXEC, 100);
  for (size_t i = 0; i < n; ++i) {
    // dup2 leaves the new number without FD_CLOEXEC: exactly what the child inherits.
    if (moved[i] < 0 || ::dup2(moved[i], options.inherit_fds[i].second) < 0) {
      int err = errno;
      (void)!::write(error_write, &err, sizeof err);
      ::_exit(127);
    }
  }
  ::execve(argv[0], argv, envp);
  int err = errno;
  (void)!::write(error_write, &err, sizeof err);
  ::_exit(127);
}

}  // namespace

std::string ExitStatus::describe() const {
  if (exited) return fmt::format("exit code {}", code);
  return fmt::format("signal {} ({})", signal, ::strsignal(signal));
}

Result<ChildProcess> ChildProcess::spawn(const std::vector<std::string>& argv, const SpawnOptions& options) {
  if (argv.empty()) return fail(EINVAL, "spawn: empty command");
  if (options.inherit_fds.size() > 64) return fail(EINVAL, "spawn {}: more than 64 inherited fds", argv[0]);
  std::vector<char*> cargv;
  for (const std::string& arg : argv) cargv.push_back(const_cast<char*>(arg.c_str()));
  cargv.push_back(nullptr);
  // Built before fork: the child may only make async-signal-safe calls.
  auto overridden = [&](std::string_view entry) {
    const std::string_view name = entry.substr(0, entry.find('=') + 1);  // "NAME="
    return std::any_of(options.env.begin(), options.env.end(),
                       [&](const std::string& set) { return std::string_view(set).starts_with(name); });
  };
  std::vector<char*> cenv;
  for (char** entry = environ; *entry != nullptr; ++entry)
    if (!overridden(*entry)) cenv.push_back(*entry);
  for (const std::string& set : options.env) cenv.push_back(const_cast<char*>(set.c_str()));
  cenv.push_back(nullptr);

  int error_pipe[2];
  if (::pipe2(error_pipe, O_CLOEXEC) != 0) return fail(errno, "spawn {}: pipe", argv[0]);
  Fd error_read(error_pipe[0]), error_write(error_pipe[1]);
  Fd out_read, out_write;
  if (options.capture_stdout) {
    int out_pipe[2];
    if (::pipe2(out_pipe, O_CLOEXEC) != 0) return fail(errno, "spawn {}: stdout pipe", argv[0]);
    out_read.reset(out_pipe[0]);
    out_write.reset(out_pipe[1]);
  }

  Fd stderr_file;
  if (!options.stderr_path.empty()) {
    stderr_file.reset(::open(options.stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    if (!stderr_file) return fail(errno, "spawn {}: opening {} for its stderr", argv[0], options.stderr_path);
  }

  const pid_t pid = ::fork();
  if (pid < 0) return fail(errno, "spawn {}: fork", argv[0]);
  if (pid == 0) exec_child(cargv.data(), cenv.data(), options, out_write.get(), stderr_file.get(), error_write.get());
  // Also from the parent: whichever runs first, the group exists before anyone signals it.
  ::setpgid(pid, pid);
  error_write.reset();
  out_write.reset();

  ChildProcess child;
  child.pid_ = pid;
  child.stdout_ = std::move(out_read);
  int child_errno = 0;
  ssize_t got;
  do got = ::read(error_read.get(), &child_errno, sizeof child_errno);
  while (got < 0 && errno == EINTR);
  if (got == static_cast<ssize_t>(sizeof child_errno)) {
    child.kill_group();
    return fail(child_errno, "exec {}", argv[0]);
  }
  return child;
}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)),
      stdout_(std::move(other.stdout_)),
      out_(std::move(other.out_)),
      status_(std::move(other.status_)) {}

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this != &other) {
    kill_group();
    pid_ = std::exchange(other.pid_, -1);
    stdout_ = std::move(other.stdout_);
    out_ = std::move(other.out_);
    status_ = std::move(other.status_);
  }
  return *this;
}

ChildProcess::~ChildProcess() { kill_group(); }

void ChildProcess::drain_stdout(int timeout_ms) {
  if (!stdout_) {
    if (timeout_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
    return;
  }
  pollfd pfd{stdout_.get(), POLLIN, 0};
  const int ready = ::poll(&pfd, 1, timeout_ms);
  if (ready <= 0) return;
  char buffer[4096];
  const ssize_t got = ::read(stdout_.get(), buffer, sizeof buffer);
  if (got > 0) {
    if (out_.size() < kMaxCapturedBytes) out_.append(buffer, static_cast<size_t>(got));
  } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
    stdout_.reset();  // EOF: the child (and anything holding its stdout) is done writing
  }
}

std::optional<ExitStatus> ChildProcess::poll_exit() {
  if (status_) return status_;
  if (pid_ < 0) return std::nullopt;
  int status = 0;
  const pid_t got = ::waitpid(pid_, &status, WNOHANG);
  if (got == pid_) status_ = decode_wait_status(status);
  return status_;
}

Result<Finished> ChildProcess::wait_for(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (true) {
    if (auto status = poll_exit()) {
      // What the child wrote before it ended; a grandchild still holding the pipe open
      // must not keep us here, so stop at the first empty poll.
      while (stdout_) {
        pollfd pfd{stdout_.get(), POLLIN, 0};
        if (::poll(&pfd, 1, 0) <= 0) break;
        drain_stdout(0);
      }
      return Finished{*status, out_};
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return fail(ETIMEDOUT, "pid {} still running after {} ms", pid_, timeout.count());
    drain_stdout(static_cast<int>(std::min<long long>(left.count(), 10)));
  }
}

void ChildProcess::kill_group() noexcept {
  if (pid_ < 0) return;
  if (!status_) {
    ::kill(-pid_, SIGKILL);
    ::kill(pid_, SIGKILL);
    int status = 0;
    pid_t got;
    do got = ::waitpid(pid_, &status, 0);
    while (got < 0 && errno == EINTR);
    if (got == pid_) status_ = decode_wait_status(status);
  } else {
    ::kill(-pid_, SIGKILL);  // the group may outlive its leader
  }
  pid_ = -1;
  stdout_.reset();
}

ExitStatus ChildProcess::terminate(std::chrono::milliseconds grace) noexcept {
  if (pid_ < 0) return status_.value_or(ExitStatus{});
  if (!poll_exit()) {
    ::kill(-pid_, SIGTERM);
    const auto deadline = Clock::now() + grace;
    while (!poll_exit() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill_group();
  return status_.value_or(ExitStatus{});
}

std::optional<double> reported_prefill_ms(const std::string& out) {
  size_t end = out.find_last_not_of(" \t\r\n");
  if (end == std::string::npos) return std::nullopt;
  size_t begin = out.rfind('\n', end);
  begin = begin == std::string::npos ? 0 : begin + 1;
  const nlohmann::json line = nlohmann::json::parse(out.substr(begin, end - begin + 1), nullptr, false);
  if (!line.is_object()) return std::nullopt;
  auto it = line.find("prefill_ms");
  if (it == line.end() || !it->is_number()) return std::nullopt;
  const double ms = it->get<double>();
  if (!(ms >= 0)) return std::nullopt;
  return ms;
}

}  // namespace kvshare::route
