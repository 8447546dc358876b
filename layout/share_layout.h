// share_layout (as the patch series' src/llama-kvshare.cpp places it): where every
// cache tensor sits inside the exported region, chunked at 1 GiB, one fd per chunk, each
// chunk with its FNV-1a layout hash over type and shape. Same model and params must give
// byte-identical offsets, sizes and hashes to the patched llama-server's.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "layout/memory_shape.h"

namespace kvshare::layout {

// 4096, not the runtime page size: the decoder's layout fixes it, whatever the host.
inline constexpr uint64_t kShareAlign = 4096;
inline constexpr uint64_t kShareChunkMax = uint64_t{1} << 30;
// The layout hash starts from the decimal 1469598103934665603: FNV-1a's offset basis
// (14695981039346656037) missing its last digit, not the textbook 0xcbf29ce484222325.
// It is the format: the vectors and every decoder's and provider's hashes start from it.
inline constexpr uint64_t kLayoutHashSeed = 1469598103934665603ull;  // 0x14650fb0739d0383
inline constexpr uint64_t kLayoutHashPrime = 1099511628211ull;

struct SharedTensor {
  CacheTensor tensor;
  uint32_t cache_index = 0;   // which cache object: index into kv_caches, or kv_caches.size() for recurrent
  uint32_t chunk = 0;         // global chunk index = position in the fd list
  uint64_t offset = 0;        // byte offset inside the chunk, 4096-aligned
  uint64_t padded_bytes = 0;  // pad4096(nbytes)
};

struct ShareChunk {
  uint32_t cache_index = 0;
  uint64_t size_bytes = 0;  // >= 4096, a multiple of 4096
  uint64_t layout_hash = 0;
};

struct ShareLayout {
  std::vector<ShareChunk> chunks;     // fd order: per cache object, per chunk
  std::vector<SharedTensor> tensors;  // creation order
  uint64_t total_bytes() const;
  const SharedTensor* find(std::string_view name) const;
  // The K or V (or R/S) tensor of layer il in the given cache object; nullptr if none.
  const SharedTensor* find(uint32_t cache_index, uint32_t il, TensorKind kind) const;
};

// Chunks and places every tensor of every cache object of `memory`.
ShareLayout share_layout(const MemoryShape& memory);

// Narrows `memory` and `layout` to stream `stream` of every multi-stream KV cache: each
// such tensor becomes its [.., .., 1, 1] slice (a stream is contiguous in ggml's layout,
// V transposed or not) at its offset plus stream * the slice's bytes. What a reader of one
// sequence (the reference transformer) sees of a region with one stream per slot.
// EINVAL when `stream` is past a cache's n_stream. Recurrent tensors are unchanged.
Result<void> narrow_to_stream(MemoryShape& memory, ShareLayout& layout, uint32_t stream);

// The per-chunk hash step: h = (h ^ v) * prime for v = type, ne[0..3] as 64-bit words.
uint64_t layout_hash_step(uint64_t hash, const CacheTensor& tensor);

}  // namespace kvshare::layout
