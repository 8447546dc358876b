// serve's side of kvshare-remote-receiver (kvshare/remote/receiver_service.h): the process is
// started once, kept across requests (its UCX worker, endpoints and registration of the
// decoder's region live as long as it does), and supervised. Its death is never serve's:
// a receiver that exits, breaks the protocol or stops answering is killed and reaped, the
// request in flight falls back with its exit status as the reason, and the next request
// starts another after a bounded back-off (said on the log, counted in /metrics).
//
// Killing it is the safe end of any grant: the receiver's mappings of the decoder's cache
// go with the process, so once it is reaped no peer write can land.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <mutex>
#include <optional>
#include <string>

#include "kvshare/fd.h"
#include "kvshare/route/metrics.h"
#include "kvshare/share/spawn.h"
#include "layout/error.h"
#include "layout/receiver_message.h"

namespace kvshare::route {

// After a death the next start waits kFirstReceiverBackoff, doubling per death in a row up to
// kMaxReceiverBackoff; a handoff that completes resets it.
inline constexpr std::chrono::milliseconds kFirstReceiverBackoff{100};
inline constexpr std::chrono::milliseconds kMaxReceiverBackoff{5000};

class RemoteReceiverProcess {
 public:
  struct Options {
    std::filesystem::path program;      // kvshare-remote-receiver
    std::filesystem::path private_dir;  // serve's 0700 slot directory (the share sockets go there)
    std::function<void(const std::string&)> log;
    Metrics* metrics = nullptr;
    std::chrono::milliseconds hello_timeout{60000};  // a busy machine's start, not a measurement
  };

  explicit RemoteReceiverProcess(Options options);
  // Closes the channel (the receiver exits on it), then SIGTERM with a grace, then SIGKILL.
  ~RemoteReceiverProcess();
  RemoteReceiverProcess(const RemoteReceiverProcess&) = delete;
  RemoteReceiverProcess& operator=(const RemoteReceiverProcess&) = delete;

  // A receiver runs when this returns: a dead one is reaped and its end said, and another is
  // started once the back-off since the last death has passed (EAGAIN naming the wait before
  // it). A start that fails (exec, no hello within hello_timeout) counts as a death (ESRCH).
  Result<void> ensure_running();

  // One request and its reply (a reply with ok false is a reply, not an error). Blocks at most
  // `timeout`. ESRCH when the receiver is gone, died during the call, broke the protocol or did
  // not answer in time: it has then been killed and reaped, and the message names its pid and
  // how it ended ("the remote receiver (pid 4121) died: signal 6 (Aborted)").
  Result<layout::ReceiverReply> call(const layout::ReceiverRequest& request, std::chrono::milliseconds timeout);

  // A handoff went through: the back-off starts from scratch.
  void note_success();
  // The running receiver's pid, -1 when none runs.
  pid_t pid() const;
  // How many times a receiver was started after an earlier one had exited.
  unsigned long long restarts() const;

 private:
  Result<void> start_locked();
  // The receiver is unusable: kill what is left, reap it, remember the death. Returns the
  // sentence that says how it ended.
  std::string lose_locked(const std::string& what_happened);
  std::chrono::milliseconds backoff_locked() const;

  Options options_;
  mutable std::mutex mutex_;
  ChildProcess child_;
  Fd channel_;
  pid_t pid_ = -1;
  int deaths_in_a_row_ = 0;
  bool ever_started_ = false;
  unsigned long long restarts_ = 0;
  std::optional<std::chrono::steady_clock::time_point> last_death_;
  std::string last_end_;  // how the last receiver ended, for EAGAIN's message
};

}  // namespace kvshare::route
