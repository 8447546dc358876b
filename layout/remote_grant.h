// What a remote share grants a peer: cells 0..n_cells-1 of every K and V tensor of the one
// KV cache, and nothing else. The decoder checks every incoming write against the grant
// before a byte lands; the provider uses the same ranges to know what to send. Pure
// arithmetic over share_layout: no transport, so every rule is a unit test on arrays.
// docs/remote.md gives the rules and why writes are checked here, not by the transport.
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

// The grant: which layout, how many cells from cell 0. Refuses (EINVAL) a memory shape it
// cannot describe as "cells 0..n-1": more than one cache object, more than one stream, or
// n_cells of 0 or past kv_size (ERANGE).
struct CellGrant {
  const ShareLayout* layout = nullptr;
  const MemoryShape* memory = nullptr;
  uint32_t n_cells = 0;
};
Result<void> check_grant(const CellGrant& grant);

// The ranges holding cells [cell_begin, cell_end) of layer `il`'s K then V tensor: one per
// tensor when rows are cell-major, one per V element row when V is transposed (v_trans,
// where a cell is a column). Empty when the layer has no such tensor.
std::vector<ChunkRange> cell_ranges(const ShareLayout& layout, const MemoryShape& memory, uint32_t il,
                                    uint32_t cell_begin, uint32_t cell_end);

// Bytes the provider sends for `n_cells` cells of every layer (the sum of cell_ranges).
uint64_t granted_bytes(const ShareLayout& layout, const MemoryShape& memory, uint32_t n_cells);

// Accepts a write of `size_bytes` at `offset` in `chunk` only if it lies wholly inside the
// granted cells of one tensor (and, for a transposed V, inside one element row). EFAULT
// naming the chunk, offset, size and the tensor (or "no tensor") otherwise; EINVAL for an
// empty write. Overflow-safe for any 64-bit inputs.
Result<void> check_write(const CellGrant& grant, uint32_t chunk, uint64_t offset, uint64_t size_bytes);

// One hash over the whole layout (every chunk's layout_hash and size, in fd order): what
// the completion message repeats so the decoder knows the provider wrote this layout.
uint64_t whole_layout_hash(const ShareLayout& layout);

}  // namespace kvshare::layout
