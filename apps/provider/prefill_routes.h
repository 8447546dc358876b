// The two prefills of kvshare-prefill, over a model loaded once: into the decoder's
// imported region (the shared route) and into a llama.cpp sequence-state file (the file
// route). Both forms of the provider run these: the per-request one (prefill_provider.h)
// loads the model, runs one and exits; the resident one (resident_provider.h) keeps the
// model loaded and the region mapped, and runs one per request from kvshare-serve.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "apps/provider/private_kv.h"
#include "kvshare/region/chunk_file.h"
#include "kvshare/region/importer.h"
#include "layout/error.h"
#include "layout/kv_params.h"
#include "layout/share_header.h"
#include "layout/state_format.h"
#include "refmodel/engine.h"

namespace kvshare::refmodel {

struct PrefillReport {
  uint32_t n_tokens = 0;     // ids in the ids file
  uint32_t n_prefilled = 0;  // of them computed and written here: n_tokens less --cached
  double prefill_ms = 0;     // forward pass + writing/scattering, model load excluded
  double forward_ms = 0;     // the transformer alone
  double write_ms = 0;       // state-file writes and commit, or the scatter
  std::string route;         // "file" or "shared"
};

// How errors name the ids and the numbers that bound them: the per-request tool's ids file
// and flags ("ids file ids.txt", "--cached", "-c"), or a resident request's fields.
struct IdsSource {
  std::string ids;  // "ids file ids.txt"
  std::string cached = "--cached";
  std::string n_ctx = "-c";
  std::string stream = "--stream";
  std::string first_cell = "--first-cell";
  std::string n_cells = "--cells";
};

// A model loaded for prefills: read-only mapped, the mapping kept as long as the model.
struct ProviderModel {
  std::shared_ptr<const Model> model;
  std::string path;  // names the model in errors
};

// Maps `model_path` read-only and loads it. Errors name the path and the key or tensor.
Result<ProviderModel> load_provider_model(const std::string& model_path);

// EINVAL naming the first id at or past the model's vocabulary, its entry and the size.
Result<void> check_ids_in_vocabulary(const ProviderModel& model, std::span<const int32_t> ids, const IdsSource& source);

// Our own share header for the decoder's KV `params`: what the decoder's header must equal
// in everything that changes the bytes (layout::check_compatible).
Result<layout::ShareHeader> provider_share_header(const ProviderModel& model, const layout::KvParams& params);

// EINVAL naming `source.cached`, P, the ids and their count: P must be below the number
// of ids, whose last one's K/V (and the decoder's first logits) come from this prefill.
Error cached_bound_error(uint32_t n_cached, size_t n_ids, const IdsSource& source);

// ERANGE when `n_ids` do not fit the region's cache; cached_bound_error when `n_cached`
// leaves no id to prefill.
Result<void> check_region_fits(const layout::ShareHeader& header, size_t n_ids, uint32_t n_cached,
                               const IdsSource& source);

// The decoder's region, imported writable and checked against the model.
struct RegionTarget {
  const layout::ShareHeader& header;  // the decoder's
  const ImportedShare& imported;
  // Per chunk, ImportedShare::chunk_files() to write memfd chunks with pwrite(): a fresh
  // mapping's first-touch faults cost more than the copy (kvshare/region/chunk_file.h).
  // Empty: every write goes through the mapping, for a resident provider that faulted it
  // in once when it mapped the region.
  std::vector<ChunkFile> chunk_files;
  // The KV stream written (the decoder's slot, llama-server -np N without --kv-unified):
  // only its cells change, the other streams keep every byte.
  uint32_t stream = 0;
  // The share's run of cells of that stream (a unified cache of several slots): id p is
  // written at cell first_cell + p, p < n_cells. n_cells 0 (first_cell then 0): no range,
  // cells 0.. as before ranges.
  uint32_t first_cell = 0;
  uint32_t n_cells = 0;
};

// The share's range against the region and the prompt, before anything is written:
// EINVAL naming `source.n_cells` for a range past the kv_size of any KV cache (or
// `source.first_cell` without n_cells), ERANGE when `n_ids` do not fit n_cells, ENOTSUP
// for n_cached > 0 with first_cell > 0 (a unified cache's share never has cached cells:
// the decoder answers n_cached 0).
Result<void> check_region_cells(const layout::ShareHeader& header, uint32_t first_cell, uint32_t n_cells, size_t n_ids,
                                uint32_t n_cached, const IdsSource& source);

// EINVAL naming `source.stream` when `stream` is past the region's n_stream; ENOTSUP for
// n_cached > 0 on a cache of several streams (the incremental route's Context over the
// region holds one stream). Nothing is written by then.
Result<void> check_region_stream(const layout::ShareHeader& header, uint32_t stream, uint32_t n_cached,
                                 const IdsSource& source);

// Prefills `ids` into the region. n_cached 0: a private KV cache for the prompt, each
// layer's rows scattered into cells 0..N-1 (kvshare::scatter). n_cached P > 0: cells
// 0..P-1 hold ids 0..P-1 already; a Context over the region itself attends over them and
// writes cells P..N-1 only. Holds the dma-buf CPU-access bracket (read_write when P > 0)
// during the writes. Only target.stream's cells are written, and with a range id p goes to
// cell target.first_cell + p. Checks the ids, the stream and the range first
// (check_ids_in_vocabulary, check_region_fits, check_region_stream, check_region_cells).
// Blocks for the forward pass; `n_threads` 0: all cores. With n_cached 0 the private cache
// is `own`'s, reused when it fits (a resident provider keeps one; a per-request one passes
// a fresh one).
Result<PrefillReport> prefill_region(const ProviderModel& model, const RegionTarget& target,
                                     std::span<const int32_t> ids, uint32_t n_cached, int n_threads,
                                     const IdsSource& source, PrivateContext& own);

// Where the file route writes, with the decoder's KV params and state version.
struct StateFileTarget {
  std::string path;
  layout::KvParams params;
  uint32_t state_version = layout::kStateSeqVersionLatest;  // the decoder's LLAMA_STATE_SEQ_VERSION
};

// Writes a sequence-state file of `ids` at positions 0..N-1 (statefile::StateFileWriter:
// a temporary file renamed on success, so no partial file is left on any failure). Checks
// the ids first: check_ids_in_vocabulary, then ERANGE when they do not fit the context.
// The Context and its cache are `own`'s, as for prefill_region.
Result<PrefillReport> prefill_state_file(const ProviderModel& model, const StateFileTarget& target,
                                         std::span<const int32_t> ids, int n_threads, const IdsSource& source,
                                         PrivateContext& own);

}  // namespace kvshare::refmodel
