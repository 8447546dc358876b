// A helper process serve keeps across requests and talks to over one AF_UNIX stream socket,
// one length-prefixed frame out and one back: the remote receiver
// (remote_receiver_process.h) and a resident prefill provider (resident_provider.h). This
// is their one supervisor:
//   - started (argv, the channel inherited at fd 3, dying with serve) or, for a provider
//     someone else runs, connected to at a socket path in a private directory, its uid
//     checked (connect_checked_listener);
//   - its first frame is its hello, which the owner checks;
//   - a process that exits, breaks the protocol or does not answer in time is lost: killed
//     (its process group for a child; SIGKILL through a pidfd for a connected peer, whose
//     pid SO_PEERCRED gave) and reaped or waited for, so nothing it mapped can still be
//     written to when the request in flight falls back. The reason is said on the log;
//   - the next ensure_running starts (or connects) again after a back-off that doubles per
//     loss in a row (kFirstResidentBackoff .. kMaxResidentBackoff), reset by note_success.
// Its death is never serve's.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvshare/fd.h"
#include "kvshare/share/spawn.h"
#include "layout/error.h"

namespace kvshare::route {

inline constexpr std::chrono::milliseconds kFirstResidentBackoff{100};
inline constexpr std::chrono::milliseconds kMaxResidentBackoff{5000};

class ResidentProcess {
 public:
  struct Options {
    std::string name;               // "the remote receiver": the log's and the errors' subject
    std::vector<std::string> argv;  // started with the channel at kFirstInheritedFd
    std::string connect_path;       // instead of argv: a process listening here (not started by serve)
    std::function<void(const std::string&)> log;
    std::function<void()> on_restart;  // a start (or connect) after an earlier one was lost
    // Checks the first frame's body; an error loses the process, naming it.
    std::function<Result<void>(std::string_view hello)> check_hello;
    std::chrono::milliseconds hello_timeout{60000};  // a busy machine's start (a model load), not a measurement
    uint32_t max_frame_bytes = 1u << 20;
  };

  explicit ResidentProcess(Options options);
  // Closes the channel (the process exits on it), then for a child SIGTERM with a grace and
  // SIGKILL; a connected peer is only disconnected.
  ~ResidentProcess();
  ResidentProcess(const ResidentProcess&) = delete;
  ResidentProcess& operator=(const ResidentProcess&) = delete;

  // A process runs and said hello when this returns. A dead one (or a peer that hung up) is
  // lost first. Within the back-off after a loss: EAGAIN naming the wait. A start that fails
  // (exec, connect, no hello within hello_timeout, a refused hello) is a loss: ESRCH.
  Result<void> ensure_running();

  // Sends `body` (with `fds`, borrowed, in SCM_RIGHTS) and returns the reply's body. Blocks
  // at most `timeout`. ESRCH when the process is not running, died or hung up during the
  // call, sent fds, or did not answer in time: it has then been lost, and the message says
  // how it ended ("the resident provider (pid 4121) did not answer a prefill request within
  // 2000 ms and was killed: signal 9 (Killed)"). `what` names the request ("prefill").
  Result<std::string> call(std::string_view body, std::span<const int> fds, std::chrono::milliseconds timeout,
                           std::string_view what);

  // The owner found a reply that breaks the protocol: the process is lost (if it is still
  // `incarnation`). Returns ESRCH with the sentence.
  Error lose(uint64_t incarnation, const std::string& what_happened);

  void note_success();
  pid_t pid() const;                    // -1 when none runs
  uint64_t incarnation() const;         // counts starts (and connects): what a region was sent to
  unsigned long long restarts() const;  // starts after an earlier process was lost

 private:
  Result<void> start_locked();
  // `wait_for_exit`: the channel broke, so the process is likely on its way out and its own
  // exit status (an abort) is the better reason; else (a hang, a protocol break) it is
  // killed at once.
  std::string lose_locked(const std::string& what_happened, bool wait_for_exit = true);
  std::chrono::milliseconds backoff_locked() const;
  bool running_locked();
  void end_peer_locked(std::optional<ExitStatus>& status);

  Options options_;
  mutable std::mutex mutex_;
  ChildProcess child_;  // argv mode
  Fd peer_pidfd_;       // connect mode: the listener's process, for SIGKILL and its end
  Fd channel_;
  pid_t pid_ = -1;
  uint64_t incarnation_ = 0;
  int losses_in_a_row_ = 0;
  bool ever_started_ = false;
  unsigned long long restarts_ = 0;
  std::optional<std::chrono::steady_clock::time_point> last_loss_;
  std::string last_end_;
};

}  // namespace kvshare::route
