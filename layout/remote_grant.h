// What a remote share grants a peer: cells [cell_begin, cell_end) of one stream of every K
// and V tensor of the one KV cache, and nothing else. The decoder checks every incoming
// write against the grant before a byte lands; the provider uses the same ranges to know
// what to send. Pure arithmetic over share_layout: no transport, so every rule is a unit
// test on arrays. docs/remote.md gives the rules and why writes are checked here, not by
// the transport.
#pragma once

#include <cstdint>
#include <vector>

#include "layout/error.h"
#include "layout/memory_shape.h"
#include "layout/share_layout.h"

namespace kvshare::layout {

// One byte range of one chunk: [offset, offset + size_bytes).
struct ChunkRange {
  uint32_t chunk = 0;
  uint64_t offset = 0;
  uint64_t size_bytes = 0;
};

// The grant: which layout, which stream, which cells. A prompt of positions 0..n_cells-1
// placed from `first_cell`, of which the decoder holds the first n_cached, grants
// cell_begin = first_cell + n_cached .. cell_end = first_cell + n_cells (grant_cells).
// The stream is llama.cpp's: with -np N and no --kv-unified slot s decodes from stream s;
// a unified cache has one stream and each slot reserves a run of cells in it.
struct CellGrant {
  const ShareLayout* layout = nullptr;
  const MemoryShape* memory = nullptr;
  uint32_t stream = 0;
  uint32_t cell_begin = 0;
  uint32_t cell_end = 0;
  uint32_t n_cells() const { return cell_end > cell_begin ? cell_end - cell_begin : 0; }
};

// Refuses (EINVAL, naming what) a memory a grant cannot describe as "these cells of one
// stream": more than one cache object (iSWA: the SWA cache's cells are placed on their
// own), recurrent state (llama.cpp assigns its cells at decode time), a stream past
// n_stream; ERANGE for an empty range or one past kv_size.
Result<void> check_grant(const CellGrant& grant);

// The grant of positions n_cached..n_cells-1 of a prompt placed from `first_cell` of
// `stream`, checked (check_grant): EINVAL when n_cached >= n_cells (nothing to grant),
// ERANGE when first_cell + n_cells overflows or passes kv_size (naming the three).
Result<CellGrant> grant_cells(const ShareLayout& layout, const MemoryShape& memory, uint32_t stream,
                              uint32_t first_cell, uint32_t n_cached, uint32_t n_cells);

// The ranges holding cells [cell_begin, cell_end) of `stream` of layer `il`'s K then V
// tensor: one per tensor when rows are cell-major, one per V element row when V is
// transposed (v_trans, where a cell is a column). Stream s starts s * kv_size rows into a
// tensor, as llama.cpp's [n_embd, kv_size, n_stream] tensors and kvshare::scatter place it.
// Empty when the layer has no such tensor or the range is empty.
std::vector<ChunkRange> cell_ranges(const ShareLayout& layout, const MemoryShape& memory, uint32_t il, uint32_t stream,
                                    uint32_t cell_begin, uint32_t cell_end);

// Bytes the provider sends for the grant's cells of every layer (the sum of cell_ranges;
// the same for any stream and any first cell).
uint64_t granted_bytes(const CellGrant& grant);

// Accepts a write of `size_bytes` at `offset` in `chunk` only if it lies wholly inside the
// granted cells of the granted stream of one tensor (and, for a transposed V, inside one
// element row). EFAULT naming the chunk, offset, size, the tensor (or "no tensor") and the
// stream the write falls in when it is another; EINVAL for an empty write. Overflow-safe
// for any 64-bit inputs.
Result<void> check_write(const CellGrant& grant, uint32_t chunk, uint64_t offset, uint64_t size_bytes);

// One hash over the whole layout (every chunk's layout_hash and size, in fd order): what
// the completion message repeats so the decoder knows the provider wrote this layout.
uint64_t whole_layout_hash(const ShareLayout& layout);

}  // namespace kvshare::layout
