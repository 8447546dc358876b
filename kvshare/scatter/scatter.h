// The K/V row scatter: what a prefill engine calls to write its per-token K|V rows into
// the decoder's cache inside the shared region, converting to the cache type on the way.
//
// A prefill produces, per layer, one contiguous row per token: n_embd_k_gqa K values then
// n_embd_v_gqa V values, in f32, f16 or bf16. The cache (layout::share_layout) holds per
// layer cache_k_l<il> ([n_stream][kv_size][n_embd_k_gqa], position-major) and cache_v_l<il>,
// either position-major like K (flash attention) or transposed: with v_trans, element j of
// cell c in stream s sits at element s*v_width*kv_size + j*kv_size + c, and the rows
// n_embd_v_gqa..v_width-1 of a narrower layer are written as zeros (llama_kv_cache::cpy_v
// pads with ggml_pad, mirrored here).
//
// Quantized caches are rotated first, as llama.cpp does (layout::kv_rotation_group).
// The per-row conversion is layout::convert_row; the state-file writer calls that same
// function, so both routes produce the same bytes.
//
// A recurrent or hybrid memory also holds, per recurrent layer, cache_r_l<il> (the conv
// history, [n_embd_r, rs_size] f32) and cache_s_l<il> (the SSM / delta state,
// [n_embd_s, rs_size] f32; 0 wide for LFM2), one row per cell (llama_memory_recurrent).
// write_state puts one such row in place; the element order inside it is the model's
// graph's (spec llama-memory-kinds.md section 3.1, docs/provider.md) and is not checked.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvshare/region/chunk_file.h"
#include "layout/error.h"
#include "layout/memory_shape.h"
#include "layout/share_layout.h"

namespace kvshare {

// Where a scatter writes. Borrows everything: the layout and shape must outlive the call,
// and `chunks` are kvshare's own writable mappings of the region's fds (one per
// ShareLayout chunk, in fd order), never a driver-made mapping of an imported buffer.
struct ScatterTarget {
  const layout::ShareLayout& layout;
  const layout::MemoryShape& memory;
  std::vector<std::span<std::byte>> chunks;  // [chunk] mapped bytes, fd order
  uint32_t cache_index = 0;                  // which KV cache of `memory` (0, or 1 for SWA)
  // The head sizes every layer of the cache shares (llama.cpp's n_embd_head_{k,v}_all),
  // needed to rotate quantized caches. When layers differ llama.cpp rotates nothing: set
  // ScatterBatch::rotation_disabled then.
  uint32_t n_embd_head_k = 0;
  uint32_t n_embd_head_v = 0;
  // Optional, one per chunk in fd order (ImportedShare::chunk_files): position-major rows
  // of a chunk with a writable descriptor are converted into a small buffer of the
  // provider's own and written with pwrite(), not through `chunks`. A fresh process's
  // mapping takes one page fault per 4 KiB page on first write (kvshare/region/chunk_file.h
  // has the figures); the descriptor does not. Empty: everything goes through `chunks`.
  // A transposed V (one element per cell row) always goes through `chunks`.
  std::vector<ChunkFile> chunk_files;
};

// One layer's rows in the provider's buffer: token t's row starts at
// data + t * ScatterBatch::row_stride bytes, K first then V.
struct LayerRows {
  uint32_t il = 0;  // model layer index (the L of cache_k_l<L>)
  const void* data = nullptr;
  uint32_t n_embd_k_gqa = 0;  // what the provider produced; checked against the cache
  uint32_t n_embd_v_gqa = 0;  // 0 for a K-only (MLA) layer
};

struct ScatterBatch {
  std::vector<LayerRows> layers;  // any subset of the cache's layers, any order
  uint32_t pos0 = 0;              // first cell written
  uint32_t n_tokens = 0;          // cells pos0 .. pos0 + n_tokens - 1
  uint32_t stream = 0;            // which stream (non-unified multi-sequence caches)
  layout::GgmlType src_type = layout::GgmlType::F32;
  uint64_t row_stride = 0;         // bytes between consecutive tokens' rows, >= row size
  bool rotation_disabled = false;  // the decoder runs with LLAMA_ATTN_ROT_DISABLE=1
  unsigned n_threads = 0;          // 0: std::thread::hardware_concurrency()
};

// Converts and writes every row of `batch` into `target`. Blocks until done; splits the
// work across layers and token ranges on n_threads threads. Checks everything before
// writing anything: an unknown layer, a width that differs from the cache tensor, a
// position range past kv_size, a stream past n_stream, a chunk span shorter than the
// layout says, a quantized transposed V or an unsupported type fail with EINVAL naming the
// layer, tensor and position, and the region is left untouched. With chunk_files, a
// pwrite that fails (EBADF for a descriptor not open for writing, ENOSPC, ...) ends the
// scatter with that error naming the layer, tensor and chunk; rows written before it stay.
Result<void> scatter(const ScatterTarget& target, const ScatterBatch& batch);

// The checks scatter makes, without writing (for planners such as plan_layer_dma).
Result<void> validate_scatter(const ScatterTarget& target, const ScatterBatch& batch);

// One recurrent layer's state row for one cell, as the provider computed it.
struct StateRow {
  uint32_t il = 0;                                  // model layer index (the L of cache_r_l<L>)
  layout::TensorKind kind = layout::TensorKind::r;  // r: conv history, s: SSM / delta state
  uint32_t cell = 0;                                // the row of the tensor; 0 with one sequence
  std::span<const float> values;                    // n_embd_r or n_embd_s f32 values
};

// The width in f32 values of layer il's R or S row (n_embd_r / n_embd_s; 0 for LFM2's S).
// Fails with ENOENT for a layer without recurrent state (or a memory without any) and
// EINVAL for a kind other than r or s; the message names the layer.
Result<uint64_t> state_width(const layout::ShareLayout& layout, const layout::MemoryShape& memory, uint32_t il,
                             layout::TensorKind kind);

// Writes `row` into row `row.cell` of cache_r_l<il> or cache_s_l<il> of `target` (its
// cache_index and head sizes are not used: the recurrent state is its own cache object).
// The values are f32, as the tensors are: copied, not converted. Like scatter, a chunk
// with a writable ChunkFile is written with pwrite(), others through `chunks`. Checks
// everything before writing anything: EINVAL for a layer without recurrent state, a kind
// other than r or s, a value count that differs from the row width, or a chunk span
// shorter than the layout says; ERANGE for a cell >= rs_size. Messages name the layer,
// tensor, cell and both widths. Only the row's bytes are written.
Result<void> write_state(const ScatterTarget& target, const StateRow& row);

// What gather reads back for one layer.
struct GatherRequest {
  uint32_t il = 0;
  uint32_t pos0 = 0;
  uint32_t n_tokens = 0;
  uint32_t stream = 0;
  bool undo_rotation = false;  // apply the (self-inverse) rotation again after decoding
  bool rotation_disabled = false;
};

// The inverse of scatter for tests and tools: reads cells pos0.. of layer il back as f32
// rows of n_embd_k_gqa + n_embd_v_gqa values (K then V, like the provider's rows) into
// `out` (n_tokens rows). Same validation and errors as scatter.
Result<void> gather(const ScatterTarget& target, const GatherRequest& request, std::span<float> out);

}  // namespace kvshare
