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

// A transposed V stream is ne = {v_width, kv_size} stored element-major: element j of cell
// c at (j * kv_size + c) * element from the stream's start (kvshare::scatter, llama.cpp's
// v_trans views).
uint64_t v_element_row_bytes(const KvCacheShape& cache) { return cache.kv_size * v_element_bytes(cache); }

// Stream s of a tensor starts s * kv_size rows in, for K and for V either way (a transposed
// V's row_bytes is v_width elements: kv_size of them are its stream's v_width element rows).
uint64_t stream_bytes(const KvCacheShape& cache, const SharedTensor& t) {
  return static_cast<uint64_t>(cache.kv_size) * t.tensor.row_bytes;
}

}  // namespace

Result<void> check_grant(const CellGrant& grant) {
  if (grant.layout == nullptr || grant.memory == nullptr) return fail(EINVAL, "remote grant: no layout");
  const MemoryShape& memory = *grant.memory;
  if (memory.kind != MemoryKind::kv || memory.kv_caches.size() != 1 || memory.recurrent)
    return fail(EINVAL,
                "remote grant: the memory holds {} KV cache object(s){}; a remote share covers one plain "
                "KV cache (iSWA and recurrent memories take the file route)",
                memory.kv_caches.size(), memory.recurrent ? " and recurrent state" : "");
  const KvCacheShape& cache = memory.kv_caches.front();
  if (grant.stream >= cache.n_stream)
    return fail(EINVAL, "remote grant: stream {}, the KV cache has {} stream(s)", grant.stream, cache.n_stream);
  if (grant.cell_begin >= grant.cell_end || grant.cell_end > cache.kv_size)
    return fail(ERANGE, "remote grant: cells {}..{} (end exclusive) of stream {}, the cache has cells 0..{}",
                grant.cell_begin, grant.cell_end, grant.stream, cache.kv_size);
  return {};
}

Result<CellGrant> grant_cells(const ShareLayout& layout, const MemoryShape& memory, uint32_t stream,
                              uint32_t first_cell, uint32_t n_cached, uint32_t n_cells) {
  if (n_cached >= n_cells)
    return fail(EINVAL, "remote grant: n_cached {} of n_cells {}: nothing left to grant (n_cached < n_cells)", n_cached,
                n_cells);
  const uint64_t end = uint64_t{first_cell} + n_cells;
  if (end > UINT32_MAX)
    return fail(ERANGE, "remote grant: first_cell {} + n_cells {} passes any cache", first_cell, n_cells);
  const CellGrant grant{&layout, &memory, stream, first_cell + n_cached, static_cast<uint32_t>(end)};
  if (auto ok = check_grant(grant); !ok) return fail(ok.error());
  return grant;
}

std::vector<ChunkRange> cell_ranges(const ShareLayout& layout, const MemoryShape& memory, uint32_t il, uint32_t stream,
                                    uint32_t cell_begin, uint32_t cell_end) {
  std::vector<ChunkRange> ranges;
  if (memory.kv_caches.empty() || cell_end <= cell_begin) return ranges;
  const KvCacheShape& cache = memory.kv_caches.front();
  for (TensorKind kind : {TensorKind::k, TensorKind::v}) {
    const SharedTensor* t = layout.find(0, il, kind);
    if (t == nullptr) continue;
    const uint64_t n = cell_end - cell_begin;
    const uint64_t base = t->offset + stream * stream_bytes(cache, *t);
    if (!is_transposed_v(cache, *t)) {
      ranges.push_back({t->chunk, base + cell_begin * t->tensor.row_bytes, n * t->tensor.row_bytes});
      continue;
    }
    // v_trans: one element row of kv_size cells per V element of the layer; the cells
    // are a slice of every row. Rows n_embd_v_gqa..v_width-1 are padding nobody reads.
    const uint64_t elem = v_element_bytes(cache);
    uint32_t n_embd_v = 0;
    for (const KvCacheLayer& layer : cache.layers)
      if (layer.il == il) n_embd_v = layer.n_embd_v_gqa;
    for (uint32_t j = 0; j < n_embd_v; ++j)
      ranges.push_back({t->chunk, base + j * v_element_row_bytes(cache) + cell_begin * elem, n * elem});
  }
  return ranges;
}

uint64_t granted_bytes(const CellGrant& grant) {
  uint64_t total = 0;
  if (grant.layout == nullptr || grant.memory == nullptr || grant.memory->kv_caches.empty()) return 0;
  for (const KvCacheLayer& layer : grant.memory->kv_caches.front().layers)
    for (const ChunkRange& r :
         cell_ranges(*grant.layout, *grant.memory, layer.il, grant.stream, grant.cell_begin, grant.cell_end))
      total += r.size_bytes;
  return total;
}

Result<void> check_write(const CellGrant& grant, uint32_t chunk, uint64_t offset, uint64_t size_bytes) {
  if (auto ok = check_grant(grant); !ok) return ok;
  if (size_bytes == 0) return fail(EINVAL, "remote write to chunk {} at offset {}: 0 bytes", chunk, offset);
  const KvCacheShape& cache = cache_of(grant);
  for (const SharedTensor& t : grant.layout->tensors) {
    if (t.cache_index != 0 || t.chunk != chunk) continue;
    if (offset < t.offset || offset - t.offset >= t.tensor.nbytes) continue;
    // The write starts inside this tensor: it must end inside the granted cells of the
    // granted stream of it.
    const uint64_t per_stream = stream_bytes(cache, t);
    const uint64_t rel = offset - t.offset;
    const uint64_t stream = per_stream == 0 ? 0 : rel / per_stream;
    if (stream != grant.stream)
      return fail(EFAULT,
                  "remote write of {} bytes to chunk {} at offset {}: into stream {} of {}, the grant is stream {}",
                  size_bytes, chunk, offset, stream, t.tensor.name, grant.stream);
    const uint64_t in_stream = rel - stream * per_stream;
    uint64_t row_start = 0;  // where the element row holding `in_stream` starts (transposed V)
    uint64_t cell_bytes = t.tensor.row_bytes;
    if (is_transposed_v(cache, t)) {
      row_start = in_stream / v_element_row_bytes(cache) * v_element_row_bytes(cache);
      cell_bytes = v_element_bytes(cache);
    }
    const uint64_t slice_begin = row_start + grant.cell_begin * cell_bytes;
    const uint64_t slice_end = row_start + grant.cell_end * cell_bytes;
    if (in_stream < slice_begin || in_stream >= slice_end || size_bytes > slice_end - in_stream)
      return fail(EFAULT,
                  "remote write of {} bytes to chunk {} at offset {}: outside cells {}..{} of stream {} of {} "
                  "(granted bytes {}..{} of the stream{})",
                  size_bytes, chunk, offset, grant.cell_begin, grant.cell_end - 1, grant.stream, t.tensor.name,
                  slice_begin, slice_end, is_transposed_v(cache, t) ? "'s element row" : "");
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
