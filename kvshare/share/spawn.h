// The one way kvshare starts a process: serve's decoder, every provider run (file route,
// and the broker's on the shared route) and the benchmark's serve all come through here,
// so they share one set of rules:
//   - the child inherits exactly the descriptors it is told about (at the numbers it is
//     told), stdin /dev/null, and stdout/stderr as asked; every other descriptor of this
//     process is closed before exec, whatever its flags, so a socket a library opened
//     without SOCK_CLOEXEC never reaches a provider;
//   - it leads its own process group, starts with no blocked signals and SIGPIPE at its
//     default, and may ask to die with its parent (PR_SET_PDEATHSIG, set by setpriv);
//   - its group is signalled only while the leader is not yet reaped: a reaped leader's
//     group id may already belong to someone else. When the leader exits, whatever is left
//     in its group is killed before the leader is reaped;
//   - its exit status is reported as it was: an exit code (also 129..255) or a signal.
// It is glibc's posix_spawn (CLONE_VM | CLONE_VFORK, no copy of this process's page tables)
// with file actions; a descriptor that sits on a number the child's dup2s write is lifted
// above them in this process first. Measured side by side with the hand-rolled clone it
// replaced (docs/hybrid.md, "Processes and descriptors"): the same latency, and neither
// makes this process fault.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvshare/fd.h"
#include "layout/error.h"

namespace kvshare {

// How a child ended.
struct ExitStatus {
  bool exited = false;  // true: `code` is its exit code; false: it was killed by `signal`
  int code = 0;
  int signal = 0;
  bool ok() const { return exited && code == 0; }
  std::string describe() const;  // "exit code 130", "signal 9 (Killed)"
};

struct SpawnOptions {
  // (descriptor in this process (borrowed), number in the child): each is duplicated to
  // its number, which must be >= 3 and distinct. Nothing else is inherited.
  std::vector<std::pair<int, int>> inherit_fds;
  bool capture_stdout = false;    // into a pipe drained while waiting (the last kCaptureBytes kept)
  bool capture_stderr = false;    // likewise
  bool stdout_to_stderr = false;  // without capture: the child's stdout joins its stderr
  std::string stderr_path;        // without capture: stderr to this file (created 0600, truncated)
  // PR_SET_PDEATHSIG SIGTERM, set by exec'ing through setpriv (util-linux) and a shell that
  // exits 127 when the parent died before it was set; argv[0] becomes the resolved path.
  bool die_with_parent = false;
  // "NAME=VALUE" entries set in the child's environment on top of ours (a NAME we have is
  // replaced): what a child should know without a flag it might not understand.
  std::vector<std::string> env;
};

// At most this many descriptors are passed to one child (the broker passes at most
// SCM_MAX_FD = 253; the spawner's own bound only keeps its scratch space finite).
inline constexpr size_t kMaxInheritedFds = 1024;
// The last bytes of a captured stream that are kept.
inline constexpr size_t kCaptureBytes = 1 << 20;
// The first number an in-order inherited descriptor gets.
inline constexpr int kFirstInheritedFd = 3;

// `fds` (borrowed) at 3, 4, ... in order.
std::vector<std::pair<int, int>> inherit_in_order(std::span<const int> fds);
// "3,4" for n descriptors inherited in order: the provider's --fds.
std::string inherited_fd_list(size_t n_fds);

struct Finished {
  ExitStatus status;
  bool timed_out = false;  // killed (with its group) at the deadline of run_child / wait_or_kill
  double elapsed_ms = 0;   // from the spawn to the reap
  std::string out;         // captured stdout (the last kCaptureBytes)
  std::string err;         // captured stderr (the last kCaptureBytes)
  // The last non-empty line of `out`: where a provider puts its one-line summary.
  std::string last_stdout_line() const;
};

// A started child. Move-only; the destructor kills its group (SIGKILL) and reaps it, so an
// early return never leaves a process behind. Not thread-safe: one owner drives it.
class ChildProcess {
 public:
  ChildProcess() = default;  // no child
  // Starts argv[0] (a path, or a name looked up in PATH). Fails with the errno of the step
  // that failed, naming it: ENOENT/EACCES from exec, EINVAL for a bad inherit list, EBADF
  // for an inherited descriptor that is not open (checked before the spawn).
  static Result<ChildProcess> spawn(const std::vector<std::string>& argv, const SpawnOptions& options);

  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess();

  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0 && !status_; }

  // Waits at most `timeout` for the exit, draining captured output. ETIMEDOUT when it is
  // still running (it is left running: call kill_group() or terminate()).
  Result<Finished> wait_for(std::chrono::milliseconds timeout);
  // Waits at most `timeout`; at the deadline kills the group and reports timed_out.
  Finished wait_or_kill(std::chrono::milliseconds timeout);
  // Non-blocking: the status once the child has ended (and has been reaped), nullopt while
  // it runs. Drains nothing.
  std::optional<ExitStatus> poll_exit();
  // SIGKILL to the whole group (only while the leader is unreaped), then reaps. Idempotent.
  void kill_group() noexcept;
  // SIGTERM to the group, `grace` to exit, then SIGKILL. Returns how it ended.
  ExitStatus terminate(std::chrono::milliseconds grace) noexcept;

 private:
  // Reaps the child if it has exited (blocking: waits for the exit). Kills what is left of
  // its group first, while the leader's zombie still holds the group id. True once reaped.
  bool reap(bool block) noexcept;
  void drain(int timeout_ms);
  Finished finished() const;

  pid_t pid_ = -1;
  std::string program_;
  Fd pidfd_;
  Fd stdout_;
  Fd stderr_;
  std::string out_;
  std::string err_;
  std::optional<ExitStatus> status_;
  std::chrono::steady_clock::time_point started_{};
  double elapsed_ms_ = 0;
};

// Spawns, waits at most `timeout` (then kills the group) and returns what happened. Only
// a child that cannot be started is an error.
Result<Finished> run_child(const std::vector<std::string>& argv, const SpawnOptions& options,
                           std::chrono::milliseconds timeout);

}  // namespace kvshare
