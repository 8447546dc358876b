#include "layout/share_layout.h"

#include <algorithm>

namespace kvshare::layout {
namespace {

uint64_t pad_share(uint64_t bytes) { return (bytes + kShareAlign - 1) / kShareAlign * kShareAlign; }

// share_layout over one ggml context. We model one buffer type per cache object (a single
// device, or the CPU), so a cache object is one context; a decoder's extra
// buft_get_alloc_size padding is ggml_nbytes on CPU and Vulkan, the only backends that
// export dma-bufs there.
void place_cache(const std::vector<CacheTensor>& tensors, uint32_t cache_index, ShareLayout& layout) {
  if (tensors.empty()) return;  // no tensors: llama.cpp creates no context, so no chunk
  const size_t first_chunk = layout.chunks.size();
  layout.chunks.push_back({cache_index, 0, kLayoutHashSeed});
  bool chunk_has_tensor = false;
  for (const CacheTensor& tensor : tensors) {
    const uint64_t padded = pad_share(tensor.nbytes);
    // A full chunk starts a new one; a lone tensor above 1 GiB still gets its own chunk.
    if (chunk_has_tensor && layout.chunks.back().size_bytes + padded > kShareChunkMax) {
      layout.chunks.push_back({cache_index, 0, kLayoutHashSeed});
    }
    ShareChunk& chunk = layout.chunks.back();
    SharedTensor placed;
    placed.tensor = tensor;
    placed.cache_index = cache_index;
    placed.chunk = static_cast<uint32_t>(layout.chunks.size() - 1);
    placed.offset = chunk.size_bytes;
    placed.padded_bytes = padded;
    chunk.size_bytes += padded;
    chunk.layout_hash = layout_hash_step(chunk.layout_hash, tensor);
    chunk_has_tensor = true;
    layout.tensors.push_back(std::move(placed));
  }
  for (size_t c = first_chunk; c < layout.chunks.size(); ++c)
    layout.chunks[c].size_bytes = std::max(layout.chunks[c].size_bytes, kShareAlign);
}

}  // namespace

uint64_t layout_hash_step(uint64_t hash, const CacheTensor& tensor) {
  auto mix = [&](uint64_t value) { hash = (hash ^ value) * kLayoutHashPrime; };
  mix(static_cast<uint64_t>(static_cast<int64_t>(tensor.type)));
  for (int64_t extent : tensor.ne) mix(static_cast<uint64_t>(extent));
  return hash;
}

ShareLayout share_layout(const MemoryShape& memory) {
  ShareLayout layout;
  for (size_t i = 0; i < memory.kv_caches.size(); ++i)
    place_cache(memory.kv_caches[i].tensors, static_cast<uint32_t>(i), layout);
  if (memory.recurrent) place_cache(memory.recurrent->tensors, static_cast<uint32_t>(memory.kv_caches.size()), layout);
  return layout;
}

uint64_t ShareLayout::total_bytes() const {
  uint64_t total = 0;
  for (const auto& chunk : chunks) total += chunk.size_bytes;
  return total;
}

const SharedTensor* ShareLayout::find(std::string_view name) const {
  for (const auto& placed : tensors)
    if (placed.tensor.name == name) return &placed;
  return nullptr;
}

const SharedTensor* ShareLayout::find(uint32_t cache_index, uint32_t il, TensorKind kind) const {
  for (const auto& placed : tensors)
    if (placed.cache_index == cache_index && placed.tensor.layer == il && placed.tensor.kind == kind) return &placed;
  return nullptr;
}

Result<void> narrow_to_stream(MemoryShape& memory, ShareLayout& layout, uint32_t stream) {
  for (KvCacheShape& cache : memory.kv_caches)
    if (stream >= cache.n_stream)
      return fail(EINVAL, "stream {} is past the {} KV cache's {} streams", stream, cache.role, cache.n_stream);
  auto narrow = [](CacheTensor& tensor, uint32_t n_stream) {
    tensor.ne[2] = 1;
    tensor.nbytes /= n_stream;
  };
  for (KvCacheShape& cache : memory.kv_caches) {
    if (cache.n_stream == 1) continue;
    for (CacheTensor& tensor : cache.tensors) narrow(tensor, cache.n_stream);
  }
  for (SharedTensor& placed : layout.tensors) {
    if (placed.cache_index >= memory.kv_caches.size()) continue;  // recurrent: one stream of cells
    KvCacheShape& cache = memory.kv_caches[placed.cache_index];
    if (cache.n_stream == 1) continue;
    narrow(placed.tensor, cache.n_stream);
    placed.offset += uint64_t{stream} * placed.tensor.nbytes;
  }
  for (KvCacheShape& cache : memory.kv_caches) cache.n_stream = 1;
  return {};
}

}  // namespace kvshare::layout
