// serve's side of kvshare-remote-receiver (kvshare/remote/receiver_service.h): the process is
// started once, kept across requests (its UCX worker, endpoints and registration of the
// decoder's region live as long as it does), and supervised. Its death is never serve's:
// a receiver that exits, breaks the protocol or stops answering is killed and reaped, the
// request in flight falls back with its exit status as the reason, and the next request
// starts another after a bounded back-off (said on the log, counted in /metrics): the
// supervision is route/resident_process.h's.
//
// Killing it is the safe end of any grant: the receiver's mappings of the decoder's cache
// go with the process, so once it is reaped no peer write can land.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <mutex>
#include <string>

#include "layout/error.h"
#include "layout/receiver_message.h"
#include "route/metrics.h"
#include "route/resident_process.h"

namespace kvshare::route {

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

  // One request and its reply (a reply with ok false is a reply, not an error). Safe to call
  // from several threads at once (serve runs one handoff per slot): one request and its
  // reply are on the channel at a time, the others wait their turn. Blocks at most
  // `timeout` once it is this call's turn. ESRCH when the receiver is gone, died during the call, broke the protocol or
  // did not answer in time: it has then been killed and reaped, and the message names its pid and how it ended ("the
  // remote receiver (pid 4121) died: signal 6 (Aborted)").
  Result<layout::ReceiverReply> call(const layout::ReceiverRequest& request, std::chrono::milliseconds timeout);

  // A handoff went through: the back-off starts from scratch.
  void note_success();
  // The running receiver's pid, -1 when none runs.
  pid_t pid() const;
  // How many times a receiver was started after an earlier one had exited.
  unsigned long long restarts() const;

 private:
  ResidentProcess process_;  // the supervision: start, hello, calls, losses, back-off
  // One call at a time from reading the incarnation to judging the reply: a reply that
  // breaks the protocol then loses the very receiver that sent it, never a successor
  // another thread started meanwhile.
  std::mutex calls_;
};

}  // namespace kvshare::route
