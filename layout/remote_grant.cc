#include "layout/remote_grant.h"

#include <cerrno>

#include "layout/tensor_type.h"

namespace kvshare::layout {
namespace {

const KvCacheShape& cache_of(const CellGrant& grant) { return grant.memory->kv_caches.front(); }

bool is_transposed_v(const KvCacheShape& cache, const SharedTensor& t) {
  return cache.v_trans && t.tensor.kind == TensorKind::v;
}

// Bytes of one cell in a transposed V row (one element).
uint64_t v_element_bytes(const KvCacheShape& cache) { return ggml_row_size(cache.type_v, 1); }

// A transposed V is ne = {v_width, kv_size} stored element-major: element j of cell c at
// (j * kv_size + c) * element (kvshare::scatter, llama.cpp's v_trans views).
uint64_t v_element_row_bytes(const KvCacheShape& cache) { return cache.kv_size * v_element_bytes(cache); }

}  // namespace

Result<void> check_grant(const CellGrant& grant) {
  if (grant.layout == nullptr || grant.memory == nullptr) return fail(EINVAL, "remote grant: no layout");
  const MemoryShape& memory = *grant.memory;
  if (memory.kind != MemoryKind::kv || memory.kv_caches.size() != 1 || memory.recurrent)
    return fail(EINVAL,
                "remote grant: the memory holds {} KV cache object(s){}; a remote share covers one plain "
                "KV cache",
                memory.kv_caches.size(), memory.recurrent ? " and recurrent state" : "");
  const KvCacheShape& cache = memory.kv_caches.front();
  if (cache.n_stream != 1)
    return fail(EINVAL, "remote grant: the KV cache has {} streams; a remote share covers stream 0 of one",
                cache.n_stream);
  if (grant.n_cells == 0 || grant.n_cells > cache.kv_size)
    return fail(ERANGE, "remote grant: {} cells, the cache has 1..{}", grant.n_cells, cache.kv_size);
  return {};
}

std::vector<ChunkRange> cell_ranges(const ShareLayout& layout, const MemoryShape& memory, uint32_t il,
                                    uint32_t cell_begin, uint32_t cell_end) {
  std::vector<ChunkRange> ranges;
  if (memory.kv_caches.empty() || cell_end <= cell_begin) return ranges;
  const KvCacheShape& cache = memory.kv_caches.front();
  for (TensorKind kind : {TensorKind::k, TensorKind::v}) {
    const SharedTensor* t = layout.find(0, il, kind);
    if (t == nullptr) continue;
    const uint64_t n = cell_end - cell_begin;
    if (!is_transposed_v(cache, *t)) {
      ranges.push_back({t->chunk, t->offset + cell_begin * t->tensor.row_bytes, n * t->tensor.row_bytes});
      continue;
    }
    // v_trans: one element row of kv_size cells per V element of the layer; the cells
    // are a slice of every row.
    const uint64_t elem = v_element_bytes(cache);
    uint32_t n_embd_v = 0;
    for (const KvCacheLayer& layer : cache.layers)
      if (layer.il == il) n_embd_v = layer.n_embd_v_gqa;
    for (uint32_t j = 0; j < n_embd_v; ++j)
      ranges.push_back({t->chunk, t->offset + j * v_element_row_bytes(cache) + cell_begin * elem, n * elem});
  }
  return ranges;
}

uint64_t granted_bytes(const ShareLayout& layout, const MemoryShape& memory, uint32_t n_cells) {
  uint64_t total = 0;
  if (memory.kv_caches.empty()) return 0;
  for (const KvCacheLayer& layer : memory.kv_caches.front().layers)
    for (const ChunkRange& r : cell_ranges(layout, memory, layer.il, 0, n_cells)) total += r.size_bytes;
  return total;
}

Result<void> check_write(const CellGrant& grant, uint32_t chunk, uint64_t offset, uint64_t size_bytes) {
  if (auto ok = check_grant(grant); !ok) return ok;
  if (size_bytes == 0) return fail(EINVAL, "remote write to chunk {} at offset {}: 0 bytes", chunk, offset);
  const KvCacheShape& cache = cache_of(grant);
  for (const SharedTensor& t : grant.layout->tensors) {
    if (t.cache_index != 0 || t.chunk != chunk) continue;
    if (offset < t.offset || offset - t.offset >= t.tensor.nbytes) continue;
    // The write starts inside this tensor: it must end inside the granted cells of it.
    const uint64_t rel = offset - t.offset;
    uint64_t row_start = 0;  // where the granted slice containing `rel` starts
    uint64_t granted = 0;    // its length
    if (!is_transposed_v(cache, t)) {
      granted = static_cast<uint64_t>(grant.n_cells) * t.tensor.row_bytes;
    } else {
      row_start = rel / v_element_row_bytes(cache) * v_element_row_bytes(cache);
      granted = static_cast<uint64_t>(grant.n_cells) * v_element_bytes(cache);
    }
    const uint64_t in_slice = rel - row_start;
    if (in_slice >= granted || size_bytes > granted - in_slice)
      return fail(EFAULT,
                  "remote write of {} bytes to chunk {} at offset {}: outside cells 0..{} of {} (granted "
                  "bytes {}..{} of the tensor{})",
                  size_bytes, chunk, offset, grant.n_cells - 1, t.tensor.name, row_start, row_start + granted,
                  is_transposed_v(cache, t) ? "'s element row" : "");
    return {};
  }
  return fail(EFAULT, "remote write of {} bytes to chunk {} at offset {}: no KV tensor of the share starts there",
              size_bytes, chunk, offset);
}

uint64_t whole_layout_hash(const ShareLayout& layout) {
  uint64_t h = kLayoutHashSeed;
  for (const ShareChunk& c : layout.chunks) {
    for (uint64_t v : {c.layout_hash, c.size_bytes, static_cast<uint64_t>(c.cache_index)}) {
      for (int b = 0; b < 8; ++b) {
        h ^= (v >> (8 * b)) & 0xff;
        h *= kLayoutHashPrime;
      }
    }
  }
  return h;
}

}  // namespace kvshare::layout
