#include "kvshare/remote/remote_sender.h"

#include <cerrno>
#include <deque>
#include <optional>
#include <string>

#include "kvshare/remote/ucx_common.h"

namespace kvshare::remote {
namespace {

struct Posted {
  ucs_status_ptr_t request = nullptr;  // null once completed
  uint64_t payload_bytes = 0;
  std::string what;                    // names the write in errors
  layout::RemoteHeaderBytes header{};  // kept until the send completes
};

}  // namespace

struct RemoteSender::Impl {
  std::optional<UcxWorker> ucx;
  ucp_ep_h ep = nullptr;
  std::deque<Posted> posted;  // deque: headers keep their address
  uint64_t bytes_sent = 0;
  std::optional<Error> first_error;
  ucs_status_t peer_status = UCS_OK;  // set by the endpoint's error handler

  static void on_peer_error(void* arg, ucp_ep_h, ucs_status_t status) { static_cast<Impl*>(arg)->peer_status = status; }

  // Records the outcome of completed sends; keeps the rest.
  void reap() {
    while (!posted.empty()) {
      Posted& p = posted.front();
      if (p.request != nullptr) {
        const ucs_status_t status = ucp_request_check_status(p.request);
        if (status == UCS_INPROGRESS) break;
        ucp_request_free(p.request);
        p.request = nullptr;
        if (status != UCS_OK && !first_error) {
          first_error = status == UCS_ERR_REJECTED ? Error(ECONNREFUSED, fmt::format("the decoder refused {}", p.what))
                                                   : ucx_error(status, p.what);
        } else if (status == UCS_OK) {
          bytes_sent += p.payload_bytes;
        }
      }
      posted.pop_front();
    }
  }

  Result<void> post(unsigned am_id, const layout::RemoteHeaderBytes* header_bytes, std::span<const std::byte> header,
                    std::span<const std::byte> payload, std::string what) {
    if (peer_status != UCS_OK) return fail(ucx_error(peer_status, "the decoder's endpoint failed"));
    Posted& p = posted.emplace_back();
    p.payload_bytes = payload.size();
    p.what = std::move(what);
    const void* header_ptr = header.data();
    if (header_bytes != nullptr) {
      p.header = *header_bytes;
      header_ptr = p.header.data();
    }
    ucp_request_param_t params{};
    params.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    // Rendezvous: the decoder sees the header first and pulls the payload only if it
    // accepts it, into its own pages; a refusal completes this send with REJECTED.
    params.flags = payload.empty() ? 0 : UCP_AM_SEND_FLAG_RNDV;
    ucs_status_ptr_t request =
        ucp_am_send_nbx(ep, am_id, header_ptr, header.size(), payload.data(), payload.size(), &params);
    if (UCS_PTR_IS_ERR(request)) {
      const ucs_status_t status = UCS_PTR_STATUS(request);
      posted.pop_back();
      return fail(status == UCS_ERR_REJECTED ? Error(ECONNREFUSED, "the decoder refused a write")
                                             : ucx_error(status, "ucp_am_send_nbx"));
    }
    if (request == nullptr) bytes_sent += payload.size();
    p.request = request;
    ucp_worker_progress(ucx->worker());
    reap();
    if (first_error) return fail(*first_error);
    return {};
  }
};

RemoteSender::RemoteSender(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<RemoteSender>> RemoteSender::connect(std::span<const std::byte> worker_address) {
  auto impl = std::make_unique<Impl>();
  auto ucx = UcxWorker::create("remote sender");
  if (!ucx) return fail(ucx.error());
  impl->ucx.emplace(std::move(*ucx));
  ucp_ep_params_t params{};
  params.field_mask =
      UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(worker_address.data());
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &Impl::on_peer_error;
  params.err_handler.arg = impl.get();
  if (ucs_status_t s = ucp_ep_create(impl->ucx->worker(), &params, &impl->ep); s != UCS_OK)
    return fail(
        ucx_error(s, fmt::format("connecting to the decoder's worker ({}-byte address)", worker_address.size())));
  return std::unique_ptr<RemoteSender>(new RemoteSender(std::move(impl)));
}

RemoteSender::~RemoteSender() {
  if (!impl_ || !impl_->ucx) return;
  Impl& in = *impl_;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  for (Posted& p : in.posted) {
    if (p.request == nullptr) continue;
    ucp_request_cancel(in.ucx->worker(), p.request);
    ucp_request_free(p.request);  // released by UCX when it completes
  }
  if (in.ep != nullptr) {
    ucp_request_param_t params{};
    params.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    params.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t request = ucp_ep_close_nbx(in.ep, &params);
    if (request != nullptr && !UCS_PTR_IS_ERR(request)) {
      while (ucp_request_check_status(request) == UCS_INPROGRESS && std::chrono::steady_clock::now() < give_up)
        ucp_worker_progress(in.ucx->worker());
      ucp_request_free(request);
    }
  }
}

Result<void> RemoteSender::write(const layout::RemoteWrite& header, std::span<const std::byte> payload) {
  const layout::RemoteHeaderBytes bytes = layout::encode(header);
  return impl_->post(kAmWrite, &bytes, bytes, payload,
                     fmt::format("the write of {} bytes to chunk {} at offset {} (share {})", header.size_bytes,
                                 header.chunk, header.offset, header.share_id));
}

Result<void> RemoteSender::send_raw(unsigned am_id, std::span<const std::byte> header,
                                    std::span<const std::byte> payload) {
  layout::RemoteHeaderBytes bytes{};
  const bool fits = header.size() == bytes.size();
  if (fits) std::copy(header.begin(), header.end(), bytes.begin());
  return impl_->post(am_id, fits ? &bytes : nullptr, header, payload, fmt::format("a raw message (AM id {})", am_id));
}

Result<void> RemoteSender::flush(std::chrono::steady_clock::time_point deadline) {
  Impl& in = *impl_;
  while (true) {
    in.reap();
    if (in.first_error) return fail(*in.first_error);
    if (in.posted.empty()) return {};
    if (in.peer_status != UCS_OK) return fail(ucx_error(in.peer_status, "the decoder's endpoint failed"));
    if (ucp_worker_progress(in.ucx->worker()) == 0 && std::chrono::steady_clock::now() > deadline)
      return fail(ETIMEDOUT, "{} write(s) to the decoder still pending at the deadline", in.posted.size());
  }
}

Result<void> RemoteSender::finish(const layout::RemoteDone& done, std::chrono::steady_clock::time_point deadline) {
  if (auto flushed = flush(deadline); !flushed) return flushed;
  const layout::RemoteHeaderBytes bytes = layout::encode(done);
  if (auto sent = impl_->post(kAmDone, &bytes, bytes, {}, fmt::format("the completion of share {}", done.share_id));
      !sent)
    return sent;
  if (auto flushed = flush(deadline); !flushed) return flushed;
  ucp_request_param_t params{};
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  return wait_request(impl_->ucx->worker(), ucp_ep_flush_nbx(impl_->ep, &params),
                      static_cast<int>(std::max<int64_t>(1, left.count())), "flushing the endpoint to the decoder");
}

uint64_t RemoteSender::bytes_sent() const { return impl_->bytes_sent; }

}  // namespace kvshare::remote
