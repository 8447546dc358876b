#include "kvshare/share/decoder_share.h"

#include <algorithm>
#include <cerrno>

#include "kvshare/handshake/transport.h"

namespace kvshare {

std::string share_degrade_warning(bool flag_set, std::string_view backend_reason) {
  if (!flag_set) return {};
  return fmt::format(
      "share_degrade: this decoder cannot export its KV memory ({}); share requests are refused and "
      "prompts take the state-file route",
      backend_reason);
}

std::string share_unavailable_reason(bool flag_set, std::string_view backend_reason) {
  // Flag unset: the 501 names both causes, since a caller cannot tell from outside
  // which applies; every decoder (kvshare-decoder, the patched llama-server) says this text.
  if (!flag_set)
    return "this decoder cannot share its KV cache: either ONEBIT_KV_SHARE was not set when it started (it was "
           "not: set it to any non-empty value), or its KV backend cannot export its memory";
  return fmt::format("this decoder cannot share its KV cache: ONEBIT_KV_SHARE is set, and the KV backend {}",
                     backend_reason.empty() ? std::string("was not asked to export")
                                            : fmt::format("cannot export ({})", backend_reason));
}

bool adoptable_memory_kind(layout::MemoryKind kind) {
  return kind == layout::MemoryKind::kv || kind == layout::MemoryKind::kv_iswa ||
         kind == layout::MemoryKind::recurrent || kind == layout::MemoryKind::hybrid;
}

Result<void> check_adoptable_memory_kind(layout::MemoryKind kind) {
  if (!adoptable_memory_kind(kind))
    return fail(ENOTSUP, "memory kind {} cannot be adopted yet (plain, iSWA, recurrent and hybrid memories can)",
                layout::memory_kind_name(kind));
  return {};
}

uint32_t share_n_stream(const layout::MemoryShape& memory) {
  return memory.kv_caches.empty() ? 1 : memory.kv_caches.front().n_stream;
}

ShareCells resolve_share_cells(const layout::MemoryShape& memory, ShareCells cells) {
  if (cells.n_cells > 0 || cells.first_cell == 0) return cells;
  uint32_t kv_size = UINT32_MAX;
  for (const auto& cache : memory.kv_caches) kv_size = std::min(kv_size, cache.kv_size);
  if (memory.kv_caches.empty()) kv_size = 0;
  cells.n_cells = cells.first_cell < kv_size ? kv_size - cells.first_cell : 0;
  return cells;
}

Result<ShareCells> check_cells_in_memory(const layout::ShareHeader& header, ShareCells cells) {
  const uint32_t stream = cells.stream;
  for (const auto& cache : header.memory.kv_caches) {
    if (stream >= cache.n_stream)
      return fail(EINVAL, "share of stream {}: the \"{}\" KV cache has n_stream {} (streams 0..{}; -np {}{})", stream,
                  cache.role, cache.n_stream, cache.n_stream - 1, header.params.n_seq_max,
                  header.params.kv_unified ? ", unified" : "");
  }
  if (stream >= share_n_stream(header.memory))
    return fail(EINVAL, "share of stream {}: this memory has {} stream(s)", stream, share_n_stream(header.memory));
  if (cells.names_range()) {
    if (header.memory.kv_caches.empty())
      return fail(EINVAL, "share of cells first_cell {} n_cells {}: this memory has no KV cache (kv_size 0)",
                  cells.first_cell, cells.n_cells);
    for (const auto& cache : header.memory.kv_caches) {
      const uint64_t end = uint64_t{cells.first_cell} + (cells.n_cells > 0 ? cells.n_cells : 1);
      if (end > cache.kv_size)
        return fail(EINVAL, "share of cells first_cell {} n_cells {}: past the \"{}\" KV cache's kv_size {}",
                    cells.first_cell, cells.n_cells, cache.role, cache.kv_size);
    }
  }
  return resolve_share_cells(header.memory, cells);
}

Result<void> check_tokens_fit_cells(const ShareCells& cells, uint64_t n_tokens) {
  if (cells.n_cells > 0 && n_tokens > cells.n_cells)
    return fail(ERANGE, "{} tokens do not fit the share's n_cells {} (cells {}..{} of stream {})", n_tokens,
                cells.n_cells, cells.first_cell, uint64_t{cells.first_cell} + cells.n_cells - 1, cells.stream);
  return {};
}

Result<void> check_share_cells(const layout::ShareHeader& header, const ShareCells& cells) {
  if (auto in_memory = check_cells_in_memory(header, cells); !in_memory) return fail(in_memory.error());
  const uint32_t stream = cells.stream;
  const bool range = cells.names_range();
  if (header.memory.recurrent && header.memory.recurrent->rs_size > 1)
    return fail(ENOTSUP,
                "share of stream {}: the shared route hands over a recurrent state only with one sequence "
                "(-np 1), this decoder has rs_size {} (-np {}): llama.cpp assigns recurrent cells at decode time; the "
                "file route serves this slot",
                stream, header.memory.recurrent->rs_size, header.params.n_seq_max);
  const bool unified_slots =
      !header.memory.kv_caches.empty() && header.memory.kv_caches.front().n_stream == 1 && header.params.n_seq_max > 1;
  if (unified_slots && !range)
    return fail(ENOTSUP,
                "share of stream {}: a unified KV cache (--kv-unified, or llama-server's -np auto) keeps "
                "every slot's cells in one stream (-np {}, n_stream 1): name the cells reserved for the sequence "
                "(first_cell, n_cells), or run -np N without --kv-unified; the file route serves this slot",
                stream, header.params.n_seq_max);
  if (unified_slots && header.memory.kv_caches.size() > 1)
    return fail(ENOTSUP,
                "share of cells first_cell {} n_cells {}: an iSWA memory's unified caches (-np {}) place "
                "the SWA cache's cells independently of the base cache's, so one range cannot name both; the file "
                "route serves this slot",
                cells.first_cell, cells.n_cells, header.params.n_seq_max);
  return {};
}

Result<void> check_share_stream(const layout::ShareHeader& header, uint32_t stream) {
  return check_share_cells(header, ShareCells{stream, 0, 0});
}

int http_status_for(const Error& error) {
  switch (error.errno_value()) {
    case ENOTSUP:
      return 501;
    case EPERM:
      return 403;
    case ESTALE:
      return 409;
    case ERANGE:
    case EINVAL:
      return 400;
    default:
      return 500;
  }
}

DecoderShare DecoderShare::start(layout::ShareHeader header, bool enabled, const ExportOptions& options) {
  DecoderShare share;
  share.flag_set_ = enabled;
  share.header_ = std::move(header);
  share.latest_of_stream_.resize(share_n_stream(share.header_.memory));
  if (!enabled) return share;
  auto regions = export_regions(share.header_.layout, options);
  if (!regions) {
    share.export_failure_ = regions.error().what();
    share.startup_warning_ = share_degrade_warning(true, share.export_failure_);
    return share;
  }
  share.regions_ = std::move(*regions);
  for (const auto& region : share.regions_) share.chunk_bytes_.push_back(region.mapping.bytes());
  share.header_json_ = layout::to_json(share.header_, false);
  return share;
}

DecoderShare::DecoderShare(DecoderShare&& other) noexcept
    : header_(std::move(other.header_)),
      header_json_(std::move(other.header_json_)),
      regions_(std::move(other.regions_)),
      chunk_bytes_(std::move(other.chunk_bytes_)),
      flag_set_(other.flag_set_),
      export_failure_(std::move(other.export_failure_)),
      startup_warning_(std::move(other.startup_warning_)),
      latest_share_id_(other.latest_share_id_),
      latest_of_stream_(std::move(other.latest_of_stream_)),
      shares_(std::move(other.shares_)) {}

Result<TensorView> DecoderShare::view(std::string_view name) const {
  if (!can_share()) return fail(ENOTSUP, "{}", share_unavailable_reason(flag_set_, export_failure_));
  return tensor_view(header_.layout, chunk_bytes_, name);
}

Result<LayerDestination> DecoderShare::layer(uint32_t cache_index, uint32_t il) const {
  if (!can_share()) return fail(ENOTSUP, "{}", share_unavailable_reason(flag_set_, export_failure_));
  return layer_destination(header_.layout, chunk_bytes_, cache_index, il);
}

uint64_t DecoderShare::latest_share_id() const {
  std::lock_guard lock(mutex_);
  return latest_share_id_;
}

uint64_t DecoderShare::latest_share_id(uint32_t stream) const {
  std::lock_guard lock(mutex_);
  return stream < latest_of_stream_.size() ? latest_of_stream_[stream] : 0;
}

size_t DecoderShare::n_pending_shares() const {
  std::lock_guard lock(mutex_);
  return static_cast<size_t>(std::count_if(
      shares_.begin(), shares_.end(), [](const auto& entry) { return entry.second.state == ShareState::pending; }));
}

namespace {

// Cells a share covers, as [begin, end): no range is the whole stream.
std::pair<uint64_t, uint64_t> covered_cells(uint32_t first_cell, uint32_t n_cells) {
  if (n_cells == 0) return {0, UINT64_MAX};
  return {first_cell, uint64_t{first_cell} + n_cells};
}

bool cells_overlap(uint32_t first_a, uint32_t n_a, uint32_t first_b, uint32_t n_b) {
  const auto a = covered_cells(first_a, n_a);
  const auto b = covered_cells(first_b, n_b);
  return a.first < b.second && b.first < a.second;
}

std::string describe_cells(uint32_t first_cell, uint32_t n_cells) {
  return n_cells == 0 ? std::string("the whole stream")
                      : fmt::format("cells {}..{}", first_cell, uint64_t{first_cell} + n_cells - 1);
}

}  // namespace

void DecoderShare::forget_old_shares() {
  // Pending shares stay (each stream's are disjoint, so at most its cells); of the others the
  // oldest go first.
  size_t done = 0;
  for (const auto& entry : shares_) done += entry.second.state != ShareState::pending;
  for (auto it = shares_.begin(); done > kShareHistory && it != shares_.end();) {
    if (it->second.state == ShareState::pending) {
      ++it;
      continue;
    }
    it = shares_.erase(it);
    --done;
  }
}

Result<uint64_t> DecoderShare::share(const std::string& socket_path, uint32_t stream, int timeout_ms) {
  return share(socket_path, ShareCells{stream, 0, 0}, timeout_ms);
}

Result<uint64_t> DecoderShare::share(const std::string& socket_path, ShareCells cells, int timeout_ms) {
  // A slot that has no stream of its own, or a range the cache has not, is refused before
  // anything is spent or sent.
  if (auto checked = check_share_cells(header_, cells); !checked) return fail(checked.error());
  cells = resolve_share_cells(header_.memory, cells);
  const uint32_t stream = cells.stream;
  // Only the id under the lock: connect and send may each wait their timeout, and adopt
  // must not wait behind them. Everything else read below is fixed at start().
  uint64_t share_id = 0;
  {
    std::lock_guard lock(mutex_);
    share_id = ++latest_share_id_;
    latest_of_stream_[stream] = share_id;
    // Every earlier share of this stream whose cells overlap the new one's is stale: the new
    // provider may write those cells. Disjoint runs (other slots of a unified cache) stay.
    for (auto& [id, earlier] : shares_) {
      if (earlier.state != ShareState::pending || earlier.stream != stream) continue;
      if (!cells_overlap(earlier.first_cell, earlier.n_cells, cells.first_cell, cells.n_cells)) continue;
      earlier.state = ShareState::stale;
      earlier.staled_by = share_id;
    }
    shares_[share_id] = ShareRecord{stream, cells.first_cell, cells.n_cells, ShareState::pending, 0};
    forget_old_shares();
  }
  // Nothing reached a broker: no provider will write, so the share cannot be adopted (the
  // shares it made stale stay stale: their cells may have been handed out meanwhile).
  auto unsent = [&] {
    std::lock_guard lock(mutex_);
    auto it = shares_.find(share_id);
    if (it != shares_.end() && it->second.state == ShareState::pending) it->second.state = ShareState::unsent;
  };
  if (!can_share()) {
    unsent();
    const std::string reason = share_unavailable_reason(flag_set_, export_failure_);
    // Tell a waiting broker now rather than let it time out; it may not be listening. Even
    // a refusal goes only to a listener that passed the checks.
    if (auto connection = handshake::connect_checked_listener(socket_path, timeout_ms))
      (void)handshake::send_message(connection->get(), handshake::make_refusal(share_id, "", reason), {}, timeout_ms);
    return fail(ENOTSUP, "{}", reason);
  }
  handshake::Message message;
  message.share_id = share_id;
  message.stream = stream;
  message.first_cell = cells.first_cell;
  message.n_cells = cells.n_cells;
  message.header_json = header_json_;
  std::vector<int> fds;
  for (const auto& region : regions_) {
    message.fds.push_back({region.chunk, std::string(region_backend_name(region.backend)), region.offset,
                           region.size_bytes, region.layout_hash});
    fds.push_back(region.fd.get());
  }
  // The only place this decoder's KV fds leave it: the listener is checked first.
  auto connection = handshake::connect_checked_listener(socket_path, timeout_ms);
  if (!connection) {
    unsent();
    return fail(connection.error().with_context(fmt::format("share {}", share_id)));
  }
  auto sent = handshake::send_message(connection->get(), message, fds, timeout_ms);
  if (!sent) {
    unsent();
    return fail(sent.error().with_context(fmt::format("share {} to {}", share_id, socket_path)));
  }
  return share_id;
}

Result<AdoptPlan> DecoderShare::adopt(uint64_t n_tokens, uint64_t share_id, uint32_t stream) {
  std::lock_guard lock(mutex_);
  if (!can_share()) return fail(ENOTSUP, "{}", share_unavailable_reason(flag_set_, export_failure_));
  if (stream >= latest_of_stream_.size())
    return fail(EINVAL, "adopt of share_id {} into stream {}: this decoder has {} stream(s)", share_id, stream,
                latest_of_stream_.size());
  const auto found = shares_.find(share_id);
  if (found == shares_.end()) {
    if (latest_share_id_ == 0)
      return fail(ESTALE, "adopt of share_id {}: no share has been made of stream {} since this decoder started",
                  share_id, stream);
    if (share_id == 0 || share_id > latest_share_id_)
      return fail(ESTALE, "adopt of share_id {}: no such share, the latest is {}", share_id, latest_share_id_);
    return fail(ESTALE, "adopt of share_id {}: it is stale, too old to be remembered (the latest share is {})",
                share_id, latest_share_id_);
  }
  ShareRecord& share = found->second;
  if (share.stream != stream)
    return fail(EINVAL, "adopt of share_id {} into stream {}: that share was made for stream {}", share_id, stream,
                share.stream);
  switch (share.state) {
    case ShareState::pending:
      break;
    case ShareState::adopted:
      return fail(ESTALE, "adopt of share_id {}: it was already adopted", share_id);
    case ShareState::unsent:
      return fail(ESTALE, "adopt of share_id {}: its message never reached a broker (no provider wrote it)", share_id);
    case ShareState::stale: {
      const auto later = shares_.find(share.staled_by);
      const std::string later_cells = later == shares_.end()
                                          ? std::string("cells not remembered")
                                          : describe_cells(later->second.first_cell, later->second.n_cells);
      return fail(ESTALE,
                  "adopt of share_id {}: it is stale, the later share {} of stream {} ({}) overlaps its own ({})",
                  share_id, share.staled_by, stream, later_cells, describe_cells(share.first_cell, share.n_cells));
    }
  }
  if (n_tokens == 0) return fail(EINVAL, "adopt of share_id {}: 0 tokens, nothing to adopt", share_id);
  for (const auto& cache : header_.memory.kv_caches) {
    if (n_tokens > cache.kv_size)
      return fail(ERANGE, "adopt of share_id {}: {} tokens do not fit the \"{}\" KV cache of {} cells", share_id,
                  n_tokens, cache.role, cache.kv_size);
  }
  if (auto fits = check_tokens_fit_cells(ShareCells{stream, share.first_cell, share.n_cells}, n_tokens); !fits)
    return fail(fits.error().with_context(fmt::format("adopt of share_id {}", share_id)));
  share.state = ShareState::adopted;
  const AdoptPlan plan{share_id, static_cast<uint32_t>(n_tokens), stream, share.first_cell, share.n_cells};
  forget_old_shares();
  return plan;
}

}  // namespace kvshare
