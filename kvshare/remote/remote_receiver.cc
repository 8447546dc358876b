#include "kvshare/remote/remote_receiver.h"

#include <poll.h>
#include <sys/random.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>

#include "kvshare/remote/ucx_common.h"
#include "layout/remote_grant.h"
#include "layout/remote_message.h"

namespace kvshare::remote {
namespace {

using Clock = std::chrono::steady_clock;

enum class ShareState { none, open, revoked, adopted };

const char* state_name(ShareState s) {
  switch (s) {
    case ShareState::open:
      return "open";
    case ShareState::revoked:
      return "revoked";
    case ShareState::adopted:
      return "adopted";
    default:
      return "none";
  }
}

uint64_t random_share_id() {
  uint64_t id = 0;
  while (id == 0) {
    if (::getrandom(&id, sizeof id, 0) != static_cast<ssize_t>(sizeof id)) id = 0;
  }
  return id;
}

// 128 bits from getrandom (the kernel's CSPRNG; it blocks only before the pool is first
// seeded, long before a decoder shares). Never all zero: that is what "no share" holds.
layout::RemoteSecret random_secret() {
  layout::RemoteSecret secret{};
  while (layout::same_secret(secret, layout::RemoteSecret{})) {
    if (::getrandom(secret.data(), secret.size(), 0) != static_cast<ssize_t>(secret.size())) secret = {};
  }
  return secret;
}

}  // namespace

struct RemoteReceiver::Impl {
  layout::ShareHeader header;
  std::vector<std::span<std::byte>> chunks;
  ReceiverLog log;
  std::optional<UcxWorker> ucx;
  std::vector<ucp_mem_h> memh;  // [chunk] one registration each, made once
  std::vector<std::byte> worker_address;
  int efd = -1;  // borrowed from the worker
  std::thread progress;
  std::atomic<bool> stopping{false};
  uint64_t whole_hash = 0;

  mutable std::mutex mutex;         // guards everything below
  std::condition_variable drained;  // in_flight reached 0
  ShareState state = ShareState::none;
  std::atomic<bool> is_open{false};  // state == open, for revoke's fast path
  uint64_t share_id = 0;
  layout::RemoteSecret secret{};  // the open share's; every message must carry it
  uint32_t n_cells = 0;
  Clock::time_point deadline{};
  uint64_t bytes_received = 0;
  uint32_t in_flight = 0;
  bool drain_given_up = false;  // wait_drained timed out for this share
  std::string fault;            // first refused write or failed receive of the open share
  std::optional<layout::RemoteDone> done;
  ReceiverCounters counters;

  void say(const std::string& line) {
    if (log)
      log(line);
    else
      std::fprintf(stderr, "%s\n", line.c_str());
  }

  // Called with `mutex` held. Spoils the open share when the refusal names it.
  void refuse_locked(const std::string& why, bool spoils_open_share) {
    counters.writes_refused++;
    counters.last_refusal = why;
    if (spoils_open_share && state == ShareState::open && fault.empty()) fault = why;
  }

  void close_locked(ShareState to) {
    state = to;
    is_open = false;
  }

  // Waits (at most 5 s, once per share: eval revokes before every token and must not
  // wait again on receives UCX never ends) until no receive is in flight.
  void wait_drained(std::unique_lock<std::mutex>& lock) {
    if (in_flight == 0 || drain_given_up) return;
    if (!drained.wait_for(lock, std::chrono::seconds(5), [&] { return in_flight == 0; })) {
      drain_given_up = true;
      say(
          fmt::format("kvshare remote: share {}: {} receive(s) still in flight 5 s after the revoke (a peer that "
                      "stalled mid-write); not waiting for them again",
                      share_id, in_flight));
    }
  }

  static ucs_status_t on_write(void* arg, const void* header, size_t header_length, void* data, size_t length,
                               const ucp_am_recv_param_t* param) {
    return static_cast<Impl*>(arg)->receive_write(header, header_length, data, length, param);
  }
  static ucs_status_t on_done(void* arg, const void* header, size_t header_length, void*, size_t length,
                              const ucp_am_recv_param_t*) {
    return static_cast<Impl*>(arg)->receive_done(header, header_length, length);
  }

  struct PendingReceive {
    Impl* impl;
    uint64_t share_id;
  };

  static void on_received(void* request, ucs_status_t status, size_t length, void* user_data) {
    auto* pending = static_cast<PendingReceive*>(user_data);
    pending->impl->finish_receive(pending->share_id, status, length);
    delete pending;
    ucp_request_free(request);
  }

  void finish_receive(uint64_t id, ucs_status_t status, size_t length) {
    std::lock_guard lock(mutex);
    in_flight--;
    if (status == UCS_OK && id == share_id) {
      bytes_received += length;
      counters.writes_accepted++;
      counters.bytes_accepted += length;
    } else if (status != UCS_OK) {
      refuse_locked(fmt::format("share {}: a receive of {} bytes failed mid-write ({}): the peer left or the transfer "
                                "broke",
                                id, length, ucs_status_string(status)),
                    id == share_id);
      say(counters.last_refusal);
    }
    if (in_flight == 0) drained.notify_all();
  }

  ucs_status_t receive_write(const void* header, size_t header_length, void* data, size_t length,
                             const ucp_am_recv_param_t* param) {
    const bool is_rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    // A refused rendezvous fails the sender's send with this status; refused eager data
    // is dropped when we return (it never touched the cache).
    const ucs_status_t refused = is_rndv ? UCS_ERR_REJECTED : UCS_OK;
    auto write = layout::decode_remote_write({static_cast<const std::byte*>(header), header_length});
    std::unique_lock lock(mutex);
    if (!write) {
      refuse_locked(fmt::format("remote write refused: {}", write.error().message()), false);
      say(counters.last_refusal);
      return refused;
    }
    // The secret first, compared in constant time, and a mismatch never spoils the open
    // share: a peer that saw or guessed a share_id but lacks the secret must not be able
    // to make the real provider's transfer fail (the forger is refused, the share lives on).
    if (!layout::same_secret(write->secret, secret)) {
      refuse_locked(fmt::format("remote write refused: share_id {}: the secret is not the open share's (refused, the "
                                "open share is not spoiled)",
                                write->share_id),
                    false);
      say(counters.last_refusal);
      return refused;
    }
    std::string why;
    if (write->share_id != share_id || share_id == 0) {
      why = fmt::format("remote write refused: share_id {} is not the open share", write->share_id);
    } else if (state != ShareState::open) {
      why = fmt::format("remote write refused: share {} is {}", write->share_id, state_name(state));
    } else if (Clock::now() > deadline) {
      why = fmt::format("remote write refused: share {} passed its deadline", write->share_id);
    } else if (write->size_bytes != length) {
      why = fmt::format("remote write refused: share {}: header says {} bytes, the payload has {}", write->share_id,
                        write->size_bytes, length);
    } else if (write->chunk >= chunks.size()) {
      why = fmt::format("remote write refused: share {}: chunk {}, the layout has {}", write->share_id, write->chunk,
                        chunks.size());
    } else if (auto ok = layout::check_write({&this->header.layout, &this->header.memory, n_cells}, write->chunk,
                                             write->offset, write->size_bytes);
               !ok) {
      why = fmt::format("remote write refused: share {}: {}", write->share_id, ok.error().message());
    }
    if (!why.empty()) {
      refuse_locked(why, write->share_id == share_id);
      say(why);
      return refused;
    }
    std::byte* dest = chunks[write->chunk].data() + write->offset;
    const uint64_t id = write->share_id;
    in_flight++;
    lock.unlock();
    if (!is_rndv) {
      std::memcpy(dest, data, length);
      finish_receive(id, UCS_OK, length);
      return UCS_OK;
    }
    ucp_request_param_t params{};
    params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
    params.cb.recv_am = on_received;
    params.user_data = new PendingReceive{this, id};
    params.memh = memh[write->chunk];
    ucs_status_ptr_t request = ucp_am_recv_data_nbx(ucx->worker(), data, dest, length, &params);
    if (request == nullptr) {
      delete static_cast<PendingReceive*>(params.user_data);
      finish_receive(id, UCS_OK, length);
    } else if (UCS_PTR_IS_ERR(request)) {
      delete static_cast<PendingReceive*>(params.user_data);
      finish_receive(id, UCS_PTR_STATUS(request), length);
    }
    return UCS_OK;
  }

  ucs_status_t receive_done(const void* header, size_t header_length, size_t length) {
    auto message = layout::decode_remote_done({static_cast<const std::byte*>(header), header_length});
    std::lock_guard lock(mutex);
    std::string why;
    if (!message)
      why = fmt::format("remote completion refused: {}", message.error().message());
    else if (!layout::same_secret(message->secret, secret))
      why =
          fmt::format("remote completion refused: share_id {}: the secret is not the open share's", message->share_id);
    else if (length != 0)
      why = fmt::format("remote completion refused: it carries {} payload bytes, expected none", length);
    else if (message->share_id != share_id || state != ShareState::open)
      why = fmt::format("remote completion refused: share_id {} is not the open share", message->share_id);
    if (!why.empty()) {
      refuse_locked(why, false);
      say(why);
      return UCS_OK;
    }
    done = *message;
    drained.notify_all();
    return UCS_OK;
  }

  void run_progress() {
    while (!stopping.load()) {
      while (ucp_worker_progress(ucx->worker()) != 0) {
      }
      {
        std::lock_guard lock(mutex);
        if (state == ShareState::open && Clock::now() > deadline) {
          close_locked(ShareState::revoked);
          if (fault.empty()) fault = fmt::format("share {} passed its deadline", share_id);
          say(fmt::format("kvshare remote: share {} passed its deadline: revoked, no more writes accepted", share_id));
        }
      }
      const ucs_status_t armed = ucp_worker_arm(ucx->worker());
      if (armed == UCS_ERR_BUSY) continue;
      pollfd p{efd, POLLIN, 0};
      ::poll(&p, 1, 50);
    }
  }
};

RemoteReceiver::RemoteReceiver(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<RemoteReceiver>> RemoteReceiver::start(const layout::ShareHeader& header,
                                                              std::vector<std::span<std::byte>> chunks,
                                                              ReceiverLog log) {
  if (chunks.size() != header.layout.chunks.size())
    return fail(EINVAL, "remote receiver: {} chunks given, the layout has {}", chunks.size(),
                header.layout.chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i)
    if (chunks[i].size() < header.layout.chunks[i].size_bytes)
      return fail(EINVAL, "remote receiver: chunk {} is {} bytes, the layout needs {}", i, chunks[i].size(),
                  header.layout.chunks[i].size_bytes);
  auto impl = std::make_unique<Impl>();
  impl->header = header;
  impl->chunks = std::move(chunks);
  impl->log = std::move(log);
  impl->whole_hash = layout::whole_layout_hash(header.layout);
  auto ucx = UcxWorker::create("remote receiver");
  if (!ucx) return fail(ucx.error());
  impl->ucx.emplace(std::move(*ucx));
  // One registration per chunk, once: a few large regions, never one per tensor or share.
  for (size_t i = 0; i < impl->chunks.size(); ++i) {
    ucp_mem_map_params_t map{};
    map.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    map.address = impl->chunks[i].data();
    map.length = impl->chunks[i].size();
    ucp_mem_h h = nullptr;
    if (ucs_status_t s = ucp_mem_map(impl->ucx->context(), &map, &h); s != UCS_OK) {
      for (ucp_mem_h m : impl->memh) ucp_mem_unmap(impl->ucx->context(), m);
      return fail(ucx_error(s, fmt::format("remote receiver: registering chunk {} ({} bytes)", i, map.length)));
    }
    impl->memh.push_back(h);
  }
  // From here the receiver's destructor undoes what was done (registrations, worker).
  std::unique_ptr<RemoteReceiver> receiver(new RemoteReceiver(std::move(impl)));
  Impl& in = *receiver->impl_;
  auto cleanup_on_error = [](Error e) -> Result<std::unique_ptr<RemoteReceiver>> { return fail(std::move(e)); };
  ucp_address_t* address = nullptr;
  size_t address_length = 0;
  if (ucs_status_t s = ucp_worker_get_address(in.ucx->worker(), &address, &address_length); s != UCS_OK)
    return cleanup_on_error(ucx_error(s, "remote receiver: ucp_worker_get_address"));
  in.worker_address.assign(reinterpret_cast<std::byte*>(address),
                           reinterpret_cast<std::byte*>(address) + address_length);
  ucp_worker_release_address(in.ucx->worker(), address);
  if (in.worker_address.size() > kMaxWorkerAddressBytes)
    return cleanup_on_error(Error(E2BIG, fmt::format("remote receiver: the worker address is {} bytes, past {}",
                                                     in.worker_address.size(), kMaxWorkerAddressBytes)));
  for (auto [id, cb] : {std::pair{kAmWrite, &Impl::on_write}, std::pair{kAmDone, &Impl::on_done}}) {
    ucp_am_handler_param_t handler{};
    handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                         UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    handler.id = id;
    // One callback per message, header and whole payload (or its rendezvous descriptor):
    // the check sees every write whole, never a fragment.
    handler.flags = UCP_AM_FLAG_WHOLE_MSG;
    handler.cb = cb;
    handler.arg = &in;
    if (ucs_status_t s = ucp_worker_set_am_recv_handler(in.ucx->worker(), &handler); s != UCS_OK)
      return cleanup_on_error(ucx_error(s, "remote receiver: ucp_worker_set_am_recv_handler"));
  }
  if (ucs_status_t s = ucp_worker_get_efd(in.ucx->worker(), &in.efd); s != UCS_OK)
    return cleanup_on_error(ucx_error(s, "remote receiver: ucp_worker_get_efd"));
  in.progress = std::thread([&in] { in.run_progress(); });
  return receiver;
}

RemoteReceiver::~RemoteReceiver() {
  if (!impl_) return;
  Impl& in = *impl_;
  if (in.progress.joinable()) {
    in.stopping = true;
    ucp_worker_signal(in.ucx->worker());
    in.progress.join();
  }
  if (in.ucx) {
    for (ucp_mem_h m : in.memh) ucp_mem_unmap(in.ucx->context(), m);
  }
}

Result<RemoteOffer> RemoteReceiver::grant(uint32_t n_cells, std::chrono::milliseconds timeout) {
  Impl& in = *impl_;
  const layout::CellGrant cells{&in.header.layout, &in.header.memory, n_cells};
  if (auto ok = layout::check_grant(cells); !ok) return fail(ok.error());
  revoke("a new share replaces it");
  std::lock_guard lock(in.mutex);
  in.share_id = random_share_id();
  in.secret = random_secret();
  in.n_cells = n_cells;
  in.deadline = Clock::now() + timeout;
  in.bytes_received = 0;
  in.drain_given_up = false;
  in.fault.clear();
  in.done.reset();
  in.state = ShareState::open;
  in.is_open = true;
  RemoteOffer offer;
  offer.share_id = in.share_id;
  offer.secret = in.secret;
  offer.worker_address = in.worker_address;
  offer.n_cells = n_cells;
  offer.bytes = layout::granted_bytes(in.header.layout, in.header.memory, n_cells);
  offer.layout_hash = in.whole_hash;
  offer.timeout_ms = static_cast<uint64_t>(timeout.count());
  offer.header = in.header;
  return offer;
}

void RemoteReceiver::revoke(std::string_view why) {
  Impl& in = *impl_;
  if (!in.is_open.load()) {
    // Still wait for receives of a share closed by its deadline or a refusal.
    std::unique_lock lock(in.mutex);
    in.wait_drained(lock);
    return;
  }
  std::unique_lock lock(in.mutex);
  if (in.state == ShareState::open) {
    in.close_locked(ShareState::revoked);
    in.say(fmt::format("kvshare remote: share {} revoked ({}): no more writes accepted", in.share_id, why));
  }
  in.wait_drained(lock);
}

Result<void> RemoteReceiver::complete(uint64_t share_id, uint32_t n_tokens) {
  Impl& in = *impl_;
  std::unique_lock lock(in.mutex);
  auto refuse = [&](int e, std::string why) -> Result<void> {
    if (in.state == ShareState::open) in.close_locked(ShareState::revoked);
    in.wait_drained(lock);
    return fail(e, "remote share {}: {}", share_id, why);
  };
  if (share_id != in.share_id || in.share_id == 0)
    return fail(ESTALE, "remote share {}: not the latest remote share", share_id);
  if (!in.fault.empty()) return refuse(EIO, in.fault);
  if (in.state != ShareState::open)
    return fail(ESTALE, "remote share {}: {}, not open", share_id, state_name(in.state));
  if (Clock::now() > in.deadline) return refuse(ETIMEDOUT, "passed its deadline before the adopt");
  // The completion may still sit in the worker's queue when the provider's HTTP answer
  // (which follows its endpoint flush) reaches the router first: give it a moment.
  if (!in.done && in.fault.empty())
    in.drained.wait_for(lock, std::chrono::seconds(2), [&] { return in.done.has_value() || !in.fault.empty(); });
  if (!in.fault.empty()) return refuse(EIO, in.fault);
  if (!in.done)
    return refuse(
        EIO, fmt::format("no completion message from the provider: partial transfer ({} of {} bytes "
                         "received)",
                         in.bytes_received, layout::granted_bytes(in.header.layout, in.header.memory, in.n_cells)));
  const layout::RemoteDone d = *in.done;
  const uint64_t expected =
      n_tokens <= in.n_cells ? layout::granted_bytes(in.header.layout, in.header.memory, n_tokens) : 0;
  if (n_tokens > in.n_cells)
    return refuse(ERANGE, fmt::format("adopt of {} tokens, the share granted {} cells", n_tokens, in.n_cells));
  if (d.n_tokens != n_tokens)
    return refuse(EIO, fmt::format("the completion says {} tokens, the adopt {}", d.n_tokens, n_tokens));
  if (d.layout_hash != in.whole_hash)
    return refuse(
        EIO, fmt::format("the completion's layout hash {:#x} is not this cache's {:#x}", d.layout_hash, in.whole_hash));
  if (in.in_flight != 0) return refuse(EIO, fmt::format("{} receive(s) still in flight", in.in_flight));
  if (d.bytes != in.bytes_received || in.bytes_received != expected)
    return refuse(EIO, fmt::format("byte count mismatch: the completion says {}, {} were received, {} tokens take {}",
                                   d.bytes, in.bytes_received, n_tokens, expected));
  in.close_locked(ShareState::adopted);
  return {};
}

bool RemoteReceiver::issued(uint64_t share_id) const {
  std::lock_guard lock(impl_->mutex);
  return share_id != 0 && share_id == impl_->share_id;
}

ReceiverCounters RemoteReceiver::counters() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->counters;
}

}  // namespace kvshare::remote
