// Streams a llama.cpp sequence-state file to disk as a provider computes it, layer by layer,
// without ever holding the whole KV in memory. The file appears atomically: it is written
// under a temporary name in the target directory and renamed on commit().
//
// Why offsets, not a byte stream: llama.cpp's order is "K of every layer, then V of every
// layer", while a provider finishes K and V of one layer together. The geometry fixes every
// section's offset up front (layout::plan_state_layout), so the writer splits the file into
// a few regions, each filled front to back: per KV block one region from the block start to
// its first V header and one from there to the block end (R/S alike for a recurrent block).
// Each region streams through its own aligned staging buffer into positioned io_uring
// writes; the partial 4 KiB blocks where two regions meet are kept in memory and written at
// commit. So a provider calls write_layer(il, K, V) in ascending il and every byte goes to
// disk once, in large aligned writes (O_DIRECT where the filesystem allows it).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>

#include "kvshare/statefile/io_queue.h"
#include "layout/error.h"
#include "layout/memory_shape.h"
#include "layout/state_format.h"

namespace kvshare::statefile {

// Rows one layer's section is built from: n_rows rows of n_embd elements, one per token in
// position order. The writer keeps the rows its section holds: all of them for a full cache,
// the last n_swa for a sliding-window cache (so a provider may always hand every token), the
// single last-token state for a recurrent section (hand 1 row, or all and the last is used).
struct RowsView {
  layout::GgmlType type = layout::GgmlType::F32;  // f32, f16, bf16, or the cache type itself
                                                  // (then copied unchanged: already rotated)
  const void* data = nullptr;                     // borrowed for the call
  uint32_t n_rows = 0;
  uint64_t row_stride_bytes = 0;  // 0: rows packed back to back
};

// When the temporary file is flushed to stable storage before the rename.
// Default none: the file is a handoff that llama-server reads moments later through the page
// cache; rename() alone already guarantees a reader sees no half-written file, and llama.cpp
// itself never fsyncs its slot files. A crash loses a recomputable prompt cache, nothing
// else. `data` and `data_and_directory` are for files kept across reboots (docs/state-file.md
// has the measured cost).
enum class FsyncPolicy : uint8_t { none, data, data_and_directory };

inline constexpr size_t kBufferedChunkBytes = 256u << 10;
inline constexpr size_t kDirectChunkBytes = 4u << 20;

struct StateFileWriterOptions {
  // LLAMA_STATE_SEQ_VERSION of the decoder that will restore the file (2 or 3): a decoder
  // reads only its own (docs/state-file.md, "Which version to write").
  uint32_t state_version = layout::kStateSeqVersionLatest;
  FsyncPolicy fsync = FsyncPolicy::none;
  bool allow_io_uring = true;  // false: pwrite only (also KVSHARE_NO_IO_URING=1)
  bool allow_direct = true;    // try O_DIRECT, fall back to buffered on EINVAL
  // O_DIRECT only for files of at least this size. A smaller file goes through the page
  // cache: the write is faster there than to the device, and the decoder's restore, which
  // reads it moments later with buffered reads, finds it in memory. A larger one would
  // evict the page cache and stall in dirty-page writeback, which O_DIRECT avoids.
  // docs/state-file.md has the measurements behind the default.
  uint64_t direct_min_bytes = uint64_t{1} << 30;
  // Staging buffer size, a multiple of kIoAlign; 0 = automatic: kBufferedChunkBytes for a
  // file in the page cache (it stays in L2 between conversion and copy-out),
  // kDirectChunkBytes with O_DIRECT (large device transfers).
  size_t chunk_bytes = 0;
  unsigned queue_depth = 4;  // writes in flight
  // Head sizes, for the Hadamard rotation llama.cpp applies to quantized caches
  // (layout::kv_rotation_group). 0 = unknown: quantizing a cache from f32/f16/bf16 rows then
  // fails instead of writing rows llama.cpp would misread.
  uint32_t n_embd_head_k = 0;
  uint32_t n_embd_head_v = 0;
  bool rotation_disabled = false;  // mirrors LLAMA_ATTN_ROT_DISABLE on the decoder
};

struct CommitInfo {
  std::filesystem::path path;
  uint64_t size_bytes = 0;
  uint32_t state_version = 0;   // the version word written
  const char* io_backend = "";  // "io_uring" or "pread/pwrite"
  bool is_direct = false;       // O_DIRECT was used for the whole file
};

class StateFileWriter {
 public:
  // Plans the file for sequence 0 holding `n_cells` cells at positions 0..n_cells-1 and
  // `tokens` as the cached prompt (usually n_cells == tokens.size()), creates the temporary
  // file beside `path` and writes nothing else yet. Fails on a shape/cell mismatch (see
  // layout::plan_state_layout), a quantized cache without head sizes, or open errors.
  static Result<StateFileWriter> create(const std::filesystem::path& path, const layout::MemoryShape& shape,
                                        std::span<const int32_t> tokens, int32_t n_cells,
                                        const StateFileWriterOptions& options = {});
  // Same with a ready layout (e.g. a decoded file with other cache types, for conversion).
  static Result<StateFileWriter> create_for_layout(const std::filesystem::path& path, layout::StateLayout layout,
                                                   std::span<const int32_t> tokens,
                                                   const StateFileWriterOptions& options = {});

  StateFileWriter(StateFileWriter&&) noexcept;
  StateFileWriter& operator=(StateFileWriter&&) noexcept;
  ~StateFileWriter();  // without commit(): removes the temporary file

  // K and V rows of attention layer `il` (V ignored by MLA caches: pass an empty view).
  // Layers go in ascending il per KV block; K and V may come from different buffers.
  Result<void> write_layer(uint32_t il, const RowsView& k, const RowsView& v);
  // R and S state of recurrent layer `il` (a layer of RecurrentShape::layers, not every
  // trunk layer), ascending il. A section of width 0 (LFM2's S) takes any view, empty too.
  Result<void> write_recurrent_layer(uint32_t il, const RowsView& r, const RowsView& s);
  // One section: kind k/v/r/s of layer `il`. write_layer is two of these.
  Result<void> write_section(layout::TensorKind kind, uint32_t il, const RowsView& rows);

  // Fails naming the first section never written; else flushes, applies the fsync policy
  // and renames the temporary file to the final path. After a failure the temporary file
  // is removed and the writer is spent.
  Result<CommitInfo> commit();

  const layout::StateLayout& layout() const;
  const std::filesystem::path& path() const;
  const IoStats& io_stats() const;

 private:
  struct Impl;
  explicit StateFileWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Whether LLAMA_ATTN_ROT_DISABLE is set to a non-zero number, as llama.cpp reads it.
bool attn_rotation_disabled_by_env();

}  // namespace kvshare::statefile
