#include "kvshare/remote/ucx_common.h"

#include <cerrno>
#include <chrono>

namespace kvshare::remote {

int errno_of(ucs_status_t status) {
  switch (status) {
    case UCS_OK:
      return 0;
    case UCS_ERR_TIMED_OUT:
      return ETIMEDOUT;
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
      return ECONNRESET;
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_REJECTED:
      return ECONNREFUSED;
    case UCS_ERR_NO_MEMORY:
      return ENOMEM;
    case UCS_ERR_CANCELED:
      return ECANCELED;
    case UCS_ERR_INVALID_PARAM:
      return EINVAL;
    case UCS_ERR_INVALID_ADDR:
      return EFAULT;
    case UCS_ERR_UNSUPPORTED:
      return ENOTSUP;
    default:
      return EIO;
  }
}

Error ucx_error(ucs_status_t status, std::string_view what) {
  return Error(errno_of(status), fmt::format("{}: UCX {}", what, ucs_status_string(status)));
}

Result<UcxWorker> UcxWorker::create(std::string_view who) {
  UcxWorker out;
  ucp_config_t* config = nullptr;
  if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK)
    return fail(ucx_error(s, fmt::format("{}: reading the UCX configuration", who)));
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;
  const ucs_status_t init = ucp_init(&params, config, &out.context_);
  ucp_config_release(config);
  if (init != UCS_OK) return fail(ucx_error(init, fmt::format("{}: ucp_init", who)));
  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;
  if (ucs_status_t s = ucp_worker_create(out.context_, &worker_params, &out.worker_); s != UCS_OK)
    return fail(ucx_error(s, fmt::format("{}: ucp_worker_create", who)));
  return out;
}

UcxWorker::UcxWorker(UcxWorker&& other) noexcept : context_(other.context_), worker_(other.worker_) {
  other.context_ = nullptr;
  other.worker_ = nullptr;
}

UcxWorker::~UcxWorker() {
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
}

Result<void> wait_request(ucp_worker_h worker, ucs_status_ptr_t request, int timeout_ms, std::string_view what) {
  if (request == nullptr) return {};
  if (UCS_PTR_IS_ERR(request)) return fail(ucx_error(UCS_PTR_STATUS(request), what));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  ucs_status_t status = UCS_INPROGRESS;
  while ((status = ucp_request_check_status(request)) == UCS_INPROGRESS) {
    if (ucp_worker_progress(worker) == 0 && std::chrono::steady_clock::now() > deadline) {
      ucp_request_cancel(worker, request);
      // Bounded: a request that cannot be cancelled is released when it completes.
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(1);
      while (ucp_request_check_status(request) == UCS_INPROGRESS && std::chrono::steady_clock::now() < give_up)
        ucp_worker_progress(worker);
      ucp_request_free(request);
      return fail(ETIMEDOUT, "{}: no completion within {} ms", what, timeout_ms);
    }
  }
  ucp_request_free(request);
  if (status != UCS_OK) return fail(ucx_error(status, what));
  return {};
}

}  // namespace kvshare::remote
