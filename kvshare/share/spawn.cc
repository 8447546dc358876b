#include "kvshare/share/spawn.h"

#include <fcntl.h>
#include <linux/close_range.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <filesystem>

#include "kvshare/fd.h"

extern char** environ;

namespace kvshare {
namespace {

constexpr size_t kCaptureBytes = 64 * 1024;
constexpr int kFirstInheritedFd = 3;

Result<std::string> resolve_program(const std::string& name) {
  if (name.empty()) return fail(EINVAL, "provider command is empty");
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
  return fail(ENOENT, "provider program {} is not in PATH", name);
}

void append_capped(std::string& text, const char* data, size_t n) {
  text.append(data, n);
  if (text.size() > kCaptureBytes) text.erase(0, text.size() - kCaptureBytes);
}

// Only async-signal-safe calls from here to exec: the parent may have other threads.
[[noreturn]] void exec_child(const char* program, char* const* argv, std::span<const int> inherit, int devnull,
                             int out_w, int err_w, int status_w) {
  ::setpgid(0, 0);
  const int n = static_cast<int>(inherit.size());
  // Lift every descriptor we still need above the target range first, so a dup2 onto
  // 3..3+n-1 can never clobber a source that happens to sit there.
  const int high = kFirstInheritedFd + n + 8;
  auto lift = [&](int fd) { return ::fcntl(fd, F_DUPFD_CLOEXEC, high); };
  int sources[256];
  for (int i = 0; i < n; ++i) sources[i] = lift(inherit[i]);
  const int devnull_high = lift(devnull), out_high = lift(out_w), err_high = lift(err_w);
  const int status_high = lift(status_w);
  bool ok = devnull_high >= 0 && out_high >= 0 && err_high >= 0 && status_high >= 0;
  for (int i = 0; i < n; ++i) ok = ok && sources[i] >= 0;
  // dup2 clears close-on-exec on the new descriptor: these are exactly what survives exec.
  ok = ok && ::dup2(devnull_high, 0) == 0 && ::dup2(out_high, 1) == 1 && ::dup2(err_high, 2) == 2;
  for (int i = 0; ok && i < n; ++i) ok = ::dup2(sources[i], kFirstInheritedFd + i) == kFirstInheritedFd + i;
  // Everything above the told descriptors closes at exec, even what a library opened
  // without O_CLOEXEC. The status pipe stays open until exec succeeds.
  ok = ok && ::syscall(SYS_close_range, kFirstInheritedFd + n, ~0u, CLOSE_RANGE_CLOEXEC) == 0;
  if (ok) ::execve(program, argv, environ);
  const int error = errno;
  (void)!::write(status_high, &error, sizeof error);
  ::_exit(127);
}

}  // namespace

std::string inherited_fd_list(size_t n_fds) {
  std::string text;
  for (size_t i = 0; i < n_fds; ++i) text += (i ? "," : "") + std::to_string(kFirstInheritedFd + i);
  return text;
}

std::string ChildResult::last_stdout_line() const {
  size_t end = stdout_text.size();
  while (end > 0) {
    while (end > 0 && (stdout_text[end - 1] == '\n' || stdout_text[end - 1] == '\r')) --end;
    const size_t start = stdout_text.rfind('\n', end == 0 ? 0 : end - 1);
    const size_t begin = start == std::string::npos ? 0 : start + 1;
    if (end > begin) return stdout_text.substr(begin, end - begin);
    if (begin == 0) break;
    end = begin;
  }
  return {};
}

Result<ChildResult> run_child(const std::vector<std::string>& argv, std::span<const int> inherit, int timeout_ms) {
  if (argv.empty()) return fail(EINVAL, "provider command is empty");
  if (inherit.size() > 253) return fail(EINVAL, "{} descriptors to pass, the limit is 253", inherit.size());
  auto program = resolve_program(argv[0]);
  if (!program) return fail(program.error());
  std::vector<char*> child_argv;
  for (const auto& arg : argv) child_argv.push_back(const_cast<char*>(arg.c_str()));
  child_argv.push_back(nullptr);

  Fd devnull(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (!devnull) return fail(errno, "open /dev/null for the provider's stdin");
  int out[2], err[2], status[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return fail(errno, "pipe for the provider's stdout");
  Fd out_r(out[0]), out_w(out[1]);
  if (::pipe2(err, O_CLOEXEC) != 0) return fail(errno, "pipe for the provider's stderr");
  Fd err_r(err[0]), err_w(err[1]);
  if (::pipe2(status, O_CLOEXEC) != 0) return fail(errno, "pipe for the provider's exec status");
  Fd status_r(status[0]), status_w(status[1]);

  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  if (pid < 0) return fail(errno, "fork for provider {}", *program);
  if (pid == 0) exec_child(program->c_str(), child_argv.data(), inherit, devnull.get(), out_w.get(), err_w.get(),
                           status_w.get());
  ::setpgid(pid, pid);  // also in the parent: no race with a kill at the deadline
  out_w.reset();
  err_w.reset();
  status_w.reset();

  int exec_errno = 0;
  if (::read(status_r.get(), &exec_errno, sizeof exec_errno) == static_cast<ssize_t>(sizeof exec_errno)) {
    ::waitpid(pid, nullptr, 0);
    return fail(exec_errno, "starting provider {}", *program);
  }

  ChildResult result;
  const auto deadline = start + std::chrono::milliseconds(timeout_ms);
  Fd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
  bool out_open = true, err_open = true, exited = false;
  char buffer[8192];
  while (!exited || out_open || err_open) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      ::kill(-pid, SIGKILL);
      result.timed_out = true;
      break;
    }
    pollfd fds[3] = {{out_open ? out_r.get() : -1, POLLIN, 0},
                     {err_open ? err_r.get() : -1, POLLIN, 0},
                     {exited ? -1 : pidfd.get(), POLLIN, 0}};
    const int n = ::poll(fds, 3, static_cast<int>(left.count()));
    if (n < 0 && errno != EINTR) {
      ::kill(-pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      return fail(errno, "poll on provider {} (pid {})", *program, pid);
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      const ssize_t got = ::read(fds[i].fd, buffer, sizeof buffer);
      if (got > 0) append_capped(i == 0 ? result.stdout_text : result.stderr_text, buffer, static_cast<size_t>(got));
      else if (got == 0 || errno != EINTR) (i == 0 ? out_open : err_open) = false;
    }
    // Without a pidfd (old kernel), the pipes closing stands for the exit.
    if (!pidfd) exited = !out_open && !err_open;
    else if (fds[2].fd >= 0 && fds[2].revents != 0) exited = true;
    // A grandchild may hold the pipes open after the provider exited: stop reading then.
    if (exited && (out_open || err_open)) {
      pollfd drain[2] = {{out_open ? out_r.get() : -1, POLLIN, 0}, {err_open ? err_r.get() : -1, POLLIN, 0}};
      if (::poll(drain, 2, 0) <= 0) break;
    }
  }
  // Leftovers of the group (grandchildren) go too; safe before the reap, since the
  // group id cannot be reused while the leader is an unreaped zombie.
  ::kill(-pid, SIGKILL);
  int wait_status = 0;
  while (::waitpid(pid, &wait_status, 0) < 0 && errno == EINTR) {
  }
  result.elapsed_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  result.exit_code = WIFEXITED(wait_status) ? WEXITSTATUS(wait_status) : 128 + WTERMSIG(wait_status);
  return result;
}

}  // namespace kvshare
