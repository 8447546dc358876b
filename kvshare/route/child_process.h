// Child processes the router starts: the decoder (long-lived) and the provider (one per
// request). Each runs in its own process group, so a timeout kills the provider and
// everything it started; the decoder also dies with serve (PR_SET_PDEATHSIG).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kvshare/fd.h"
#include "layout/error.h"

namespace kvshare::route {

struct SpawnOptions {
  // (descriptor in this process, number in the child): each is dup2'ed to its number and
  // so is NOT close-on-exec there; everything else we own is close-on-exec and stays behind.
  std::vector<std::pair<int, int>> inherit_fds;
  bool capture_stdout = false;   // stdout into a pipe read by wait_for(); else serve's stdout
  bool stdout_to_stderr = false; // child stdout joins serve's stderr (the decoder's chatter)
  bool die_with_parent = false;  // PR_SET_PDEATHSIG SIGTERM (the decoder)
  std::string stderr_path;       // non-empty: the child's stderr goes to this file (created 0600)
  // "NAME=VALUE" entries set in the child's environment on top of ours (a NAME we have is
  // replaced): what the child should know without a flag it might not understand.
  std::vector<std::string> env;
};

// How a child ended.
struct ExitStatus {
  bool exited = false;     // true: exit code valid; false: killed by `signal`
  int code = 0;
  int signal = 0;
  bool ok() const { return exited && code == 0; }
  std::string describe() const;  // "exit code 3", "signal 9 (Killed)"
};

struct Finished {
  ExitStatus status;
  std::string out;  // captured stdout (capture_stdout), at most 1 MiB kept
};

// A started child. Move-only; the destructor kills the group (SIGKILL) and reaps, so an
// early return never leaves a process behind.
class ChildProcess {
 public:
  ChildProcess() = default;  // no child
  // Starts argv[0] (a path; no PATH search) with `argv`. ENOENT/EACCES from exec are
  // reported here (the child writes its errno to a close-on-exec pipe).
  static Result<ChildProcess> spawn(const std::vector<std::string>& argv, const SpawnOptions& options);

  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess();

  pid_t pid() const { return pid_; }

  // Waits for the child (draining its captured stdout) at most `timeout`. ETIMEDOUT when
  // it is still running; the child is left running (call kill_group()).
  Result<Finished> wait_for(std::chrono::milliseconds timeout);
  // Non-blocking: the status when the child has ended, nullopt while it runs.
  std::optional<ExitStatus> poll_exit();
  // SIGKILL to the whole process group, then reaps the child.
  void kill_group() noexcept;
  // SIGTERM to the group, `grace` to exit, then SIGKILL. Returns how it ended.
  ExitStatus terminate(std::chrono::milliseconds grace) noexcept;

 private:
  void drain_stdout(int timeout_ms);
  pid_t pid_ = -1;
  Fd stdout_;
  std::string out_;
  std::optional<ExitStatus> status_;
};

// The last non-empty line of `out` when it is a JSON object with a numeric "prefill_ms".
std::optional<double> reported_prefill_ms(const std::string& out);

}  // namespace kvshare::route
