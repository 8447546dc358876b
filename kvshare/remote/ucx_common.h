// What the UCX receiver and sender share: one owned context + worker, the AM ids of the
// remote route, and turning a ucs_status_t into an Error. UCX is the transport, nothing
// of our own is on the wire but the two 40-byte headers of layout/remote_message.h.
#pragma once

#include <ucp/api/ucp.h>

#include <string_view>

#include "layout/error.h"

namespace kvshare::remote {

inline constexpr unsigned kAmWrite = 17;  // header: layout::RemoteWrite, payload: the rows
inline constexpr unsigned kAmDone = 18;   // header: layout::RemoteDone, no payload

// The errno that best names a UCX status (ETIMEDOUT, ECONNRESET, ECONNREFUSED, ...; EIO else).
int errno_of(ucs_status_t status);
// "`what`: UCX <status text>" with errno_of(status).
Error ucx_error(ucs_status_t status, std::string_view what);

// A UCP context (active messages and wakeup) and one worker on it, single-threaded: only
// one thread at a time may call into the worker (ucp_worker_signal excepted). UCX reads
// its UCX_* environment (UCX_TLS, UCX_NET_DEVICES) here. Move-only; destroys both.
class UcxWorker {
 public:
  static Result<UcxWorker> create(std::string_view who);
  UcxWorker(UcxWorker&& other) noexcept;
  UcxWorker& operator=(UcxWorker&&) = delete;
  ~UcxWorker();

  ucp_context_h context() const { return context_; }
  ucp_worker_h worker() const { return worker_; }

 private:
  UcxWorker() = default;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
};

// Progresses `worker` until `request` (a ucs_status_ptr_t of an _nbx call) completes or
// `timeout_ms` passes; frees the request. ETIMEDOUT cancels it first.
Result<void> wait_request(ucp_worker_h worker, ucs_status_ptr_t request, int timeout_ms, std::string_view what);

}  // namespace kvshare::remote
