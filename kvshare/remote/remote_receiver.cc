#include "kvshare/remote/remote_receiver.h"

#include <poll.h>
#include <sys/random.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
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

// One grant: its cells, its secret, and what arrived for it.
struct Grant {
  uint64_t id = 0;
  layout::RemoteSecret secret{};  // every message for this grant must carry it
  PromptCells prompt;
  layout::CellGrant cells;
  ShareState state = ShareState::open;
  Clock::time_point deadline{};
  uint64_t bytes_received = 0;
  uint32_t in_flight = 0;
  bool drain_given_up = false;  // wait_drained timed out for this grant
  std::string fault;            // first refused write or failed receive of the grant
  std::optional<layout::RemoteDone> done;
  uint64_t closed_order = 0;  // when it closed, for pruning the oldest closed grants
};

// Closed grants are kept (complete and issued still answer for them) up to this many; the
// oldest go first. Open ones are never dropped.
constexpr size_t kMaxClosedGrants = 256;

bool prompt_overlaps(const Grant& open, const layout::CellGrant& prompt) {
  return open.cells.stream == prompt.stream && open.cells.cell_begin < prompt.cell_end &&
         prompt.cell_begin < open.cells.cell_end;
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
  std::condition_variable drained;  // a grant's in_flight reached 0, or a completion arrived
  std::map<uint64_t, Grant> grants;
  std::atomic<size_t> n_open{0};         // grants in state open, for revoke_all's fast path
  std::atomic<uint32_t> n_in_flight{0};  // receives in flight over every grant
  uint64_t n_closed = 0;
  ReceiverCounters counters;

  void say(const std::string& line) {
    if (log)
      log(line);
    else
      std::fprintf(stderr, "%s\n", line.c_str());
  }

  Grant* find_locked(uint64_t id) {
    auto it = grants.find(id);
    return it == grants.end() ? nullptr : &it->second;
  }

  // Called with `mutex` held. Spoils `spoiled` (the grant whose secret the refused message
  // carried) when it is open; null spoils nothing.
  void refuse_locked(const std::string& why, Grant* spoiled) {
    counters.writes_refused++;
    counters.last_refusal = why;
    if (spoiled != nullptr && spoiled->state == ShareState::open && spoiled->fault.empty()) spoiled->fault = why;
  }

  void close_locked(Grant& grant, ShareState to) {
    if (grant.state == ShareState::open) n_open--;
    grant.state = to;
    grant.closed_order = ++n_closed;
  }

  // Drops the oldest closed grants past kMaxClosedGrants (never one with a receive in
  // flight: its callback still looks it up).
  void prune_locked() {
    size_t closed = 0;
    for (const auto& [id, g] : grants) closed += g.state != ShareState::open;
    while (closed > kMaxClosedGrants) {
      auto oldest = grants.end();
      for (auto it = grants.begin(); it != grants.end(); ++it)
        if (it->second.state != ShareState::open && it->second.in_flight == 0 &&
            (oldest == grants.end() || it->second.closed_order < oldest->second.closed_order))
          oldest = it;
      if (oldest == grants.end()) return;
      grants.erase(oldest);
      closed--;
    }
  }

  // Waits (at most 5 s, once per grant: the decoder revokes before every evaluation and
  // must not wait again on receives UCX never ends) until none of `id`'s receives is in
  // flight. The grant may be looked up again afterwards: the map only grows or loses
  // closed grants without receives, so `id` stays.
  void wait_drained(std::unique_lock<std::mutex>& lock, uint64_t id) {
    Grant* g = find_locked(id);
    if (g == nullptr || g->in_flight == 0 || g->drain_given_up) return;
    if (!drained.wait_for(lock, std::chrono::seconds(5), [&] {
          Grant* now = find_locked(id);
          return now == nullptr || now->in_flight == 0;
        })) {
      g = find_locked(id);
      g->drain_given_up = true;
      say(
          fmt::format("kvshare remote: share {}: {} receive(s) still in flight 5 s after the revoke (a peer that "
                      "stalled mid-write); not waiting for them again",
                      id, g->in_flight));
    }
  }

  // Closes `id` if open (saying why) and waits for its receives.
  void revoke_locked(std::unique_lock<std::mutex>& lock, uint64_t id, std::string_view why) {
    Grant* g = find_locked(id);
    if (g == nullptr) return;
    if (g->state == ShareState::open) {
      close_locked(*g, ShareState::revoked);
      say(fmt::format("kvshare remote: share {} revoked ({}): no more writes accepted", id, why));
    }
    wait_drained(lock, id);
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
    uint64_t grant_id;
  };

  static void on_received(void* request, ucs_status_t status, size_t length, void* user_data) {
    auto* pending = static_cast<PendingReceive*>(user_data);
    pending->impl->finish_receive(pending->grant_id, status, length);
    delete pending;
    ucp_request_free(request);
  }

  void finish_receive(uint64_t id, ucs_status_t status, size_t length) {
    std::lock_guard lock(mutex);
    n_in_flight--;
    Grant* g = find_locked(id);  // kept while a receive is in flight (prune_locked)
    if (g == nullptr) return;
    g->in_flight--;
    if (status == UCS_OK) {
      g->bytes_received += length;
      counters.writes_accepted++;
      counters.bytes_accepted += length;
    } else {
      refuse_locked(fmt::format("share {}: a receive of {} bytes failed mid-write ({}): the peer left or the transfer "
                                "broke",
                                id, length, ucs_status_string(status)),
                    g);
      say(counters.last_refusal);
    }
    if (g->in_flight == 0) drained.notify_all();
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
      refuse_locked(fmt::format("remote write refused: {}", write.error().message()), nullptr);
      say(counters.last_refusal);
      return refused;
    }
    // The grant the header names, then its secret, compared in constant time. A mismatch
    // never spoils a grant: a peer that saw or guessed a share_id but lacks its secret
    // (another grant's provider included) must not be able to make the real provider's
    // transfer fail (the forger is refused, the grant lives on).
    Grant* g = find_locked(write->share_id);
    if (g == nullptr) {
      refuse_locked(fmt::format("remote write refused: share_id {} is not the open share", write->share_id), nullptr);
      say(counters.last_refusal);
      return refused;
    }
    if (!layout::same_secret(write->secret, g->secret)) {
      refuse_locked(fmt::format("remote write refused: share_id {}: the secret is not the open share's (refused, the "
                                "open share is not spoiled)",
                                write->share_id),
                    nullptr);
      say(counters.last_refusal);
      return refused;
    }
    std::string why;
    if (g->state != ShareState::open) {
      why = fmt::format("remote write refused: share {} is {}", write->share_id, state_name(g->state));
    } else if (Clock::now() > g->deadline) {
      why = fmt::format("remote write refused: share {} passed its deadline", write->share_id);
    } else if (write->size_bytes != length) {
      why = fmt::format("remote write refused: share {}: header says {} bytes, the payload has {}", write->share_id,
                        write->size_bytes, length);
    } else if (write->chunk >= chunks.size()) {
      why = fmt::format("remote write refused: share {}: chunk {}, the layout has {}", write->share_id, write->chunk,
                        chunks.size());
    } else if (auto ok = layout::check_write(g->cells, write->chunk, write->offset, write->size_bytes); !ok) {
      why = fmt::format("remote write refused: share {}: {}", write->share_id, ok.error().message());
    }
    if (!why.empty()) {
      refuse_locked(why, g);
      say(why);
      return refused;
    }
    std::byte* dest = chunks[write->chunk].data() + write->offset;
    const uint64_t id = write->share_id;
    g->in_flight++;
    n_in_flight++;
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
    Grant* g = message ? find_locked(message->share_id) : nullptr;
    if (!message)
      why = fmt::format("remote completion refused: {}", message.error().message());
    else if (g == nullptr)
      why = fmt::format("remote completion refused: share_id {} is not the open share", message->share_id);
    else if (!layout::same_secret(message->secret, g->secret))
      why =
          fmt::format("remote completion refused: share_id {}: the secret is not the open share's", message->share_id);
    else if (length != 0)
      why = fmt::format("remote completion refused: it carries {} payload bytes, expected none", length);
    else if (g->state != ShareState::open)
      why = fmt::format("remote completion refused: share_id {} is not the open share", message->share_id);
    if (!why.empty()) {
      refuse_locked(why, nullptr);
      say(why);
      return UCS_OK;
    }
    g->done = *message;
    drained.notify_all();
    return UCS_OK;
  }

  void run_progress() {
    while (!stopping.load()) {
      while (ucp_worker_progress(ucx->worker()) != 0) {
      }
      if (n_open.load() != 0) {
        std::lock_guard lock(mutex);
        const auto now = Clock::now();
        for (auto& [id, g] : grants) {
          if (g.state != ShareState::open || now <= g.deadline) continue;
          close_locked(g, ShareState::revoked);
          if (g.fault.empty()) g.fault = fmt::format("share {} passed its deadline", id);
          say(fmt::format("kvshare remote: share {} passed its deadline: revoked, no more writes accepted", id));
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

Result<RemoteOffer> RemoteReceiver::grant(const PromptCells& cells, std::chrono::milliseconds timeout) {
  Impl& in = *impl_;
  auto granted = layout::grant_cells(in.header.layout, in.header.memory, cells.stream, cells.first_cell, cells.n_cached,
                                     cells.n_cells);
  if (!granted) return fail(granted.error());
  // The prompt's whole run of cells, cached positions included: the decoder reads those.
  layout::CellGrant prompt = *granted;
  prompt.cell_begin = cells.first_cell;
  std::unique_lock lock(in.mutex);
  std::vector<uint64_t> overlapping;
  for (const auto& [id, g] : in.grants)
    if (g.state == ShareState::open && prompt_overlaps(g, prompt)) overlapping.push_back(id);
  for (uint64_t id : overlapping)
    in.revoke_locked(lock, id,
                     fmt::format("a new share of cells {}..{} of stream {} replaces it", prompt.cell_begin,
                                 prompt.cell_end - 1, prompt.stream));
  uint64_t id = random_share_id();
  while (in.grants.contains(id)) id = random_share_id();
  Grant& g = in.grants[id];
  g.id = id;
  g.secret = random_secret();
  g.prompt = cells;
  g.cells = *granted;
  g.deadline = Clock::now() + timeout;
  g.state = ShareState::open;
  in.n_open++;
  in.prune_locked();
  RemoteOffer offer;
  offer.share_id = id;
  offer.secret = g.secret;
  offer.worker_address = in.worker_address;
  offer.stream = cells.stream;
  offer.first_cell = cells.first_cell;
  offer.n_cached = cells.n_cached;
  offer.n_cells = cells.n_cells;
  offer.bytes = layout::granted_bytes(g.cells);
  offer.layout_hash = in.whole_hash;
  offer.timeout_ms = static_cast<uint64_t>(timeout.count());
  offer.header = in.header;
  return offer;
}

void RemoteReceiver::revoke(uint64_t grant_id, std::string_view why) {
  Impl& in = *impl_;
  std::unique_lock lock(in.mutex);
  in.revoke_locked(lock, grant_id, why);
}

void RemoteReceiver::revoke_all(std::string_view why) {
  Impl& in = *impl_;
  if (in.n_open.load() == 0 && in.n_in_flight.load() == 0) return;
  std::unique_lock lock(in.mutex);
  std::vector<uint64_t> ids;
  for (const auto& [id, g] : in.grants)
    if (g.state == ShareState::open || g.in_flight != 0) ids.push_back(id);
  // Every grant is closed before any wait, so no grant keeps accepting writes while
  // another drains.
  for (uint64_t id : ids) {
    Grant& g = in.grants.at(id);
    if (g.state == ShareState::open) {
      in.close_locked(g, ShareState::revoked);
      in.say(fmt::format("kvshare remote: share {} revoked ({}): no more writes accepted", id, why));
    }
  }
  for (uint64_t id : ids) in.wait_drained(lock, id);
}

Result<uint64_t> RemoteReceiver::complete(uint64_t grant_id, uint32_t n_tokens) {
  Impl& in = *impl_;
  std::unique_lock lock(in.mutex);
  Grant* g = in.find_locked(grant_id);
  if (g == nullptr || grant_id == 0)
    return fail(ESTALE, "remote share {}: not a share this receiver holds (never granted, or replaced)", grant_id);
  auto refuse = [&](int e, std::string why) -> Result<uint64_t> {
    if (Grant* now = in.find_locked(grant_id); now != nullptr && now->state == ShareState::open)
      in.close_locked(*now, ShareState::revoked);
    in.wait_drained(lock, grant_id);
    return fail(e, "remote share {}: {}", grant_id, why);
  };
  if (!g->fault.empty()) return refuse(EIO, g->fault);
  if (g->state != ShareState::open)
    return fail(ESTALE, "remote share {}: {}, not open", grant_id, state_name(g->state));
  if (Clock::now() > g->deadline) return refuse(ETIMEDOUT, "passed its deadline before the adopt");
  // The completion may still sit in the worker's queue when the provider's HTTP answer
  // (which follows its endpoint flush) reaches the router first: give it a moment.
  if (!g->done && g->fault.empty())
    in.drained.wait_for(lock, std::chrono::seconds(2), [&] {
      const Grant* now = in.find_locked(grant_id);
      return now == nullptr || now->done.has_value() || !now->fault.empty();
    });
  g = in.find_locked(grant_id);
  if (g == nullptr) return fail(ESTALE, "remote share {}: replaced while its adopt waited", grant_id);
  if (!g->fault.empty()) return refuse(EIO, g->fault);
  if (!g->done)
    return refuse(EIO, fmt::format("no completion message from the provider: partial transfer ({} of {} bytes "
                                   "received)",
                                   g->bytes_received, layout::granted_bytes(g->cells)));
  const layout::RemoteDone d = *g->done;
  if (n_tokens <= g->prompt.n_cached || n_tokens > g->prompt.n_cells)
    return refuse(ERANGE, fmt::format("adopt of {} tokens, the share granted positions {}..{}", n_tokens,
                                      g->prompt.n_cached, g->prompt.n_cells - 1));
  layout::CellGrant adopted = g->cells;
  adopted.cell_end = g->prompt.first_cell + n_tokens;
  const uint64_t expected = layout::granted_bytes(adopted);
  if (d.n_tokens != n_tokens)
    return refuse(EIO, fmt::format("the completion says {} tokens, the adopt {}", d.n_tokens, n_tokens));
  if (d.layout_hash != in.whole_hash)
    return refuse(
        EIO, fmt::format("the completion's layout hash {:#x} is not this cache's {:#x}", d.layout_hash, in.whole_hash));
  if (g->in_flight != 0) return refuse(EIO, fmt::format("{} receive(s) still in flight", g->in_flight));
  if (d.bytes != g->bytes_received || g->bytes_received != expected)
    return refuse(EIO, fmt::format("byte count mismatch: the completion says {}, {} were received, {} tokens take {}",
                                   d.bytes, g->bytes_received, n_tokens, expected));
  in.close_locked(*g, ShareState::adopted);
  return expected;
}

bool RemoteReceiver::issued(uint64_t grant_id) const {
  std::lock_guard lock(impl_->mutex);
  return grant_id != 0 && impl_->grants.contains(grant_id);
}

size_t RemoteReceiver::open_grants() const { return impl_->n_open.load(); }

ReceiverCounters RemoteReceiver::counters() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->counters;
}

}  // namespace kvshare::remote
