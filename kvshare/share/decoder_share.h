// The decoder side of share/adopt (what llama-server / kvshare-decoder links): it owns the
// exported regions its KV cache lives in, hands them to a broker on share, and accepts
// the provider's work on adopt.
//
// Lifetime and writers: the decoder owns the regions for as long as its cache lives.
// Between a successful share(id) of stream s and adopt(n, id, s), the provider may write
// cells 0..n-1 of stream s of every cache tensor (with a run of cells, ShareCells: cells
// first_cell..first_cell+n-1, n <= n_cells) and the decoder must not touch them (the other
// streams and cells stay the decoder's: llama-server's other slots decode from them); after
// adopt the decoder owns every byte again (a late provider write is a protocol violation the
// kernel cannot stop: the broker waits for its provider to exit before the router calls
// adopt).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvshare/region/exporter.h"
#include "kvshare/region/tensor_view.h"
#include "layout/error.h"
#include "layout/share_header.h"

namespace kvshare {

inline constexpr int kShareTimeoutMs = 5000;

// What the decoder applies to its cell metadata when adopt succeeds: cells
// first_cell..first_cell+n_tokens-1 of `stream` take positions 0..n_tokens-1 of that
// stream's sequence (llama_kv_cells_adopt; with -np N and no --kv-unified, slot s decodes
// from stream s; with a unified cache, the run of cells the decoder reserved for the
// sequence); no byte of K or V moves.
struct AdoptPlan {
  uint64_t share_id = 0;
  uint32_t n_tokens = 0;
  uint32_t stream = 0;
  uint32_t first_cell = 0;  // the share's: where position 0 was written
  uint32_t n_cells = 0;     // the share's range, 0 when it named none (the whole stream)
};

// The cells a share hands over: position p of the prompt goes into cell first_cell + p of
// `stream`, for p < n_cells. n_cells 0 with first_cell 0 names no range: the whole stream
// (cells 0..kv_size-1), as before ranges. n_cells 0 with first_cell > 0: to the end of the
// stream (share() resolves it to kv_size - first_cell, the smallest KV cache's).
// A unified cache of several slots (--kv-unified, llama-server's -np auto) keeps every
// slot's cells in one stream: its decoder reserves a free run of cells for the sequence
// and names it here.
struct ShareCells {
  uint32_t stream = 0;
  uint32_t first_cell = 0;
  uint32_t n_cells = 0;  // 0: to the end of the stream
  bool names_range() const { return first_cell > 0 || n_cells > 0; }
};

// The streams a share may name: n_stream of the KV caches (every cache of a memory has the
// same), 1 for a memory without one (recurrent only).
uint32_t share_n_stream(const layout::MemoryShape& memory);

// The cells `cells` names in this memory, resolved (resolve_share_cells): EINVAL for a
// stream past n_stream (naming both) and for a range past the kv_size of any KV cache
// (naming first_cell, n_cells and kv_size). The one rule of which cells a share may name,
// for both ends: check_share_cells starts with it, and a provider checks the stream and
// range it is told to write with it (the C API's kvshare_provider_set_cells, a resident
// provider's prefill).
Result<ShareCells> check_cells_in_memory(const layout::ShareHeader& header, ShareCells cells);
// ERANGE naming both when `n_tokens` positions do not fit the n_cells of a share that named
// a range (`cells` resolved; no range: the caller checks kv_size). Adopt and a provider's
// prefill both refuse with it.
Result<void> check_tokens_fit_cells(const ShareCells& cells, uint64_t n_tokens);

// Whether a share of `cells` can hand over a sequence's cells of this memory:
// check_cells_in_memory's EINVAL; ENOTSUP for a recurrent part with rs_size > 1
// (llama.cpp assigns recurrent cells at decode time), for a unified cache with
// n_seq_max > 1 that names no range (every slot's cells in one stream: the decoder must
// name the cells it reserved for the sequence), and for such a cache with a range when the
// memory is iSWA (the SWA cache's cells are placed independently). Those are for the file
// route.
Result<void> check_share_cells(const layout::ShareHeader& header, const ShareCells& cells);
// check_share_cells of the whole stream.
Result<void> check_share_stream(const layout::ShareHeader& header, uint32_t stream);
// `cells` with n_cells resolved: first_cell > 0 and n_cells 0 becomes the cells to the end
// of the stream (the smallest KV cache's kv_size - first_cell). No range stays 0, 0.
ShareCells resolve_share_cells(const layout::MemoryShape& memory, ShareCells cells);

// The line a decoder that cannot export logs once at start (share_degrade, as the patched llama-server logs it).
// `flag_set`: ONEBIT_KV_SHARE was set; `backend_reason`: why no backend exported.
std::string share_degrade_warning(bool flag_set, std::string_view backend_reason);
// The refusal a decoder that cannot export answers share with: names both causes.
std::string share_unavailable_reason(bool flag_set, std::string_view backend_reason);

// The memory kinds the patched llama-server adopts (integrations/llama.cpp, llama-kvshare.cpp
// marks every part): plain, iSWA (cells 0..n-1 of both caches, n within the SWA cache),
// recurrent (cell 0 as the sequence's state) and hybrid (both). Not hybrid_iswa: its
// recurrent part pins the first position at n-1, so llama-server's reuse gate would
// re-process every handoff; nor an embedding model (no memory to share).
bool adoptable_memory_kind(layout::MemoryKind kind);
// ENOTSUP naming `kind` and the kinds that can be adopted when !adoptable_memory_kind(kind):
// a decoder refuses to open for sharing with it.
Result<void> check_adoptable_memory_kind(layout::MemoryKind kind);

// The HTTP status for a share/adopt refusal, by its errno: ENOTSUP 501 (cannot export),
// EPERM 403 (the listener failed a trust check), ESTALE 409 (made stale by a later
// overlapping share, never sent, or already adopted), ERANGE/EINVAL 400 (token count),
// anything else (the broker could not be reached, a send failed) 500.
int http_status_for(const Error& error);

class DecoderShare {
 public:
  // Exports one region per chunk of header.layout when `enabled` (ONEBIT_KV_SHARE). Never
  // fails: a decoder that cannot export still starts, can_share() is false, and
  // startup_warning() holds the line to log once.
  static DecoderShare start(layout::ShareHeader header, bool enabled, const ExportOptions& options);

  DecoderShare(DecoderShare&& other) noexcept;
  DecoderShare& operator=(DecoderShare&&) = delete;

  bool can_share() const { return !regions_.empty(); }
  const std::string& startup_warning() const { return startup_warning_; }
  // "memfd (passed over: ...)": which backend holds the cache, for the start-up log.
  std::string backend_description() const { return describe_backends(regions_); }
  const layout::ShareHeader& header() const { return header_; }
  const std::vector<ExportedRegion>& regions() const { return regions_; }
  // Each chunk's bytes in the decoder's own mapping, in fd order (empty if !can_share()).
  std::span<const std::span<std::byte>> chunk_bytes() const { return chunk_bytes_; }
  Result<TensorView> view(std::string_view name) const;
  Result<LayerDestination> layer(uint32_t cache_index, uint32_t il) const;

  // Hands stream `stream`'s cells (slot `stream` of llama-server -np N) to a provider:
  // connects to the broker at `socket_path`, checks who listens there
  // (handshake::connect_checked_listener: our uid or root, in a 0700 directory of ours;
  // EPERM naming the path and the fault otherwise, before any fd is sent), sends the
  // header, the stream and one fd per chunk, and returns the new share_id. Ids increase
  // across streams. The new share makes stale every earlier, not yet adopted share of the
  // same stream whose cells overlap its own, even when this call fails (a share without a
  // range covers the whole stream, so it stales every earlier share of its stream, and
  // each is staled by any later one); other streams' shares, and shares of disjoint runs of
  // the same stream (the slots of a unified cache), stay adoptable. A share that fails
  // (nothing reached a broker) is not adoptable itself. Blocks at most `timeout_ms`; does
  // not wait for the broker to answer.
  // Refused before connecting, spending no id (check_share_stream): EINVAL for a stream
  // past n_stream, ENOTSUP for a memory whose slots do not have a stream each (a unified
  // cache of several slots shares with a range: the ShareCells overload).
  // A decoder that cannot export sends the broker a refusal (best effort, so it need
  // not wait for its timeout) and fails with ENOTSUP naming both causes.
  // Mind the order: share(path, 2000) names stream 2000; a timeout goes third.
  Result<uint64_t> share(const std::string& socket_path, uint32_t stream = 0, int timeout_ms = kShareTimeoutMs);
  // The same for a run of cells of a stream (ShareCells): the message names the range
  // ("first_cell", "n_cells") when it has one, and the share remembers it for adopt.
  // Refused before connecting, spending no id, as check_share_cells says.
  Result<uint64_t> share(const std::string& socket_path, ShareCells cells, int timeout_ms = kShareTimeoutMs);

  // Accepts the provider's cells of `stream`: share_id must be a share of that stream that
  // reached a broker, was not made stale by a later overlapping share and was not adopted
  // yet (ESTALE, naming the later share and both ranges when stale); a share made for
  // another stream is EINVAL naming both streams; n_tokens must be 1..kv_size of every KV
  // cache (ERANGE / EINVAL) and, for a share that named a range, at most its n_cells
  // (ERANGE naming both). A refusal leaves the share as it was.
  Result<AdoptPlan> adopt(uint64_t n_tokens, uint64_t share_id, uint32_t stream = 0);

  // The latest share of any stream (0: none yet).
  uint64_t latest_share_id() const;
  // The latest share of `stream` (0: none yet, or a stream past n_stream).
  uint64_t latest_share_id(uint32_t stream) const;
  // How many shares could still be adopted (made, sent or sending, neither stale nor adopted).
  size_t n_pending_shares() const;
  uint32_t n_stream() const { return share_n_stream(header_.memory); }

 private:
  DecoderShare() = default;
  layout::ShareHeader header_;
  std::string header_json_;
  std::vector<ExportedRegion> regions_;
  std::vector<std::span<std::byte>> chunk_bytes_;
  bool flag_set_ = false;
  std::string export_failure_;
  std::string startup_warning_;
  // What adopt needs of one share. Kept while pending; once adopted, stale or unsent only
  // the latest kShareHistory of them, so a refusal can still say why.
  enum class ShareState { pending, adopted, stale, unsent };
  struct ShareRecord {
    uint32_t stream = 0;
    uint32_t first_cell = 0;  // the share's range (resolved; 0, 0: the whole stream)
    uint32_t n_cells = 0;
    ShareState state = ShareState::pending;
    uint64_t staled_by = 0;  // the later overlapping share (state stale)
  };
  static constexpr size_t kShareHistory = 1024;
  void forget_old_shares();                 // under mutex_
  mutable std::mutex mutex_;                // share and adopt may come from different HTTP threads
  uint64_t latest_share_id_ = 0;            // of any stream: ids increase across streams
  std::vector<uint64_t> latest_of_stream_;  // [n_stream]
  std::map<uint64_t, ShareRecord> shares_;  // by share_id
};

}  // namespace kvshare
