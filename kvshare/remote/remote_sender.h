// The provider side of the remote route: one UCX endpoint to the decoder's worker (error
// handling "peer", so a decoder that leaves fails the sends instead of hanging them), the
// writes as active messages of rendezvous size (the decoder pulls each payload into its
// own pages after checking the header), and the completion message. Single-threaded.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>

#include "layout/error.h"
#include "layout/remote_message.h"

namespace kvshare::remote {

class RemoteSender {
 public:
  // Connects to the worker at `worker_address` (the offer's). A UCX error naming the step
  // (an unreachable address fails at the first write or at flush, UCX connects lazily).
  static Result<std::unique_ptr<RemoteSender>> connect(std::span<const std::byte> worker_address);
  ~RemoteSender();

  // Posts one write: the header and `payload` (borrowed: it must stay unchanged until
  // flush() returns). Progresses earlier sends; fails with the first refusal seen so far.
  Result<void> write(const layout::RemoteWrite& header, std::span<const std::byte> payload);
  // Posts raw header bytes under AM id `am_id` (a test peer's tool for sending garbage).
  Result<void> send_raw(unsigned am_id, std::span<const std::byte> header, std::span<const std::byte> payload);

  // Waits until every posted write completed, by `deadline`. ECONNREFUSED when the
  // decoder refused a write (it names the write), ECONNRESET when it left, ETIMEDOUT.
  Result<void> flush(std::chrono::steady_clock::time_point deadline);
  // flush(), then the completion message, then an endpoint flush: when this returns the
  // decoder has received every accepted byte and the completion.
  Result<void> finish(const layout::RemoteDone& done, std::chrono::steady_clock::time_point deadline);

  // Payload bytes of completed, accepted writes.
  uint64_t bytes_sent() const;

 private:
  struct Impl;
  explicit RemoteSender(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvshare::remote
