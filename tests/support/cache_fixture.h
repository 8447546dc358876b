// A small KV cache built by hand (no GGUF needed): MemoryShape, its share layout and
// vector-backed chunks standing in for the mapped region, plus provider rows.
#pragma once

#include <fmt/format.h>

#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "kvshare/scatter/scatter.h"
#include "layout/half.h"
#include "layout/memory_shape.h"
#include "layout/share_layout.h"

namespace kvshare::testing {

struct CacheSpec {
  std::vector<uint32_t> n_embd_k;  // per layer (il = index)
  std::vector<uint32_t> n_embd_v;  // per layer; 0 = K only
  uint32_t kv_size = 64;
  uint32_t n_stream = 1;
  layout::GgmlType type_k = layout::GgmlType::F16;
  layout::GgmlType type_v = layout::GgmlType::F16;
  bool v_trans = false;
};

inline layout::CacheTensor make_tensor(const std::string& name, uint32_t il, layout::TensorKind kind,
                                       layout::GgmlType type, int64_t width, uint32_t kv_size, uint32_t n_stream) {
  layout::CacheTensor t;
  t.name = name;
  t.layer = il;
  t.kind = kind;
  t.type = type;
  t.ne = {width, kv_size, n_stream, 1};
  t.row_bytes = layout::ggml_row_size(type, width);
  t.nbytes = t.row_bytes * kv_size * n_stream;
  return t;
}

inline layout::MemoryShape make_memory(const CacheSpec& spec) {
  layout::KvCacheShape cache;
  cache.role = "kv";
  cache.kv_size = spec.kv_size;
  cache.n_stream = spec.n_stream;
  cache.type_k = spec.type_k;
  cache.type_v = spec.type_v;
  cache.v_trans = spec.v_trans;
  uint32_t widest_v = 0;
  for (uint32_t v : spec.n_embd_v) widest_v = std::max(widest_v, v);
  cache.v_width = spec.v_trans ? widest_v : 0;
  for (uint32_t il = 0; il < spec.n_embd_k.size(); ++il) {
    const uint32_t nv = spec.n_embd_v[il];
    cache.layers.push_back({il, spec.n_embd_k[il], nv, nv > 0});
    cache.tensors.push_back(make_tensor(fmt::format("cache_k_l{}", il), il, layout::TensorKind::k, spec.type_k,
                                        spec.n_embd_k[il], spec.kv_size, spec.n_stream));
    if (nv > 0)
      cache.tensors.push_back(make_tensor(fmt::format("cache_v_l{}", il), il, layout::TensorKind::v, spec.type_v,
                                          spec.v_trans ? widest_v : nv, spec.kv_size, spec.n_stream));
  }
  layout::MemoryShape memory;
  memory.kind = layout::MemoryKind::kv;
  memory.n_ctx = spec.kv_size;
  memory.n_ctx_seq = spec.kv_size;
  memory.kv_caches.push_back(std::move(cache));
  return memory;
}

// The decoder's cache in ordinary memory, pre-filled with a sentinel byte so a test can
// see what a scatter did not touch.
struct Region {
  explicit Region(const CacheSpec& spec, std::byte fill = std::byte{0xAB}) : Region(make_memory(spec), fill) {}
  // Any memory, such as a recurrent or hybrid one derived from GGUF metadata.
  explicit Region(layout::MemoryShape shape, std::byte fill = std::byte{0xAB})
      : memory(std::move(shape)), layout(layout::share_layout(memory)) {
    for (const auto& chunk : layout.chunks) storage.emplace_back(chunk.size_bytes, fill);
  }
  ScatterTarget target(uint32_t head_k = 0, uint32_t head_v = 0) {
    std::vector<std::span<std::byte>> spans;
    for (auto& bytes : storage) spans.emplace_back(bytes);
    return ScatterTarget{layout, memory, std::move(spans), 0, head_k, head_v};
  }
  std::byte* tensor(const std::string& name) {
    const layout::SharedTensor* placed = layout.find(name);
    return placed == nullptr ? nullptr : storage[placed->chunk].data() + placed->offset;
  }
  layout::MemoryShape memory;
  layout::ShareLayout layout;
  std::vector<std::vector<std::byte>> storage;
};

// Provider rows for one layer: n_tokens rows of (n_k + n_v) f32 values, then converted to
// the source type. Values are small multiples of 1/16 plus noise so f16 and bf16 keep
// most of them exactly.
struct ProviderRows {
  std::vector<float> f32;        // [n_tokens][n_k + n_v]
  std::vector<std::byte> bytes;  // the same rows in src_type, row_stride apart
  uint64_t row_stride = 0;
};

inline ProviderRows make_rows(uint32_t n_tokens, uint32_t n_k, uint32_t n_v, layout::GgmlType src_type, uint32_t seed,
                              uint64_t extra_stride_bytes = 0) {
  ProviderRows rows;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const uint64_t width = static_cast<uint64_t>(n_k) + n_v;
  rows.f32.resize(width * n_tokens);
  for (float& v : rows.f32) v = normal(rng);
  const uint64_t element = layout::ggml_row_size(src_type, 1);
  rows.row_stride = width * element + extra_stride_bytes;
  rows.bytes.assign(rows.row_stride * n_tokens, std::byte{0x5A});
  for (uint32_t t = 0; t < n_tokens; ++t) {
    for (uint64_t j = 0; j < width; ++j) {
      const float value = rows.f32[t * width + j];
      std::byte* dst = rows.bytes.data() + t * rows.row_stride + j * element;
      if (src_type == layout::GgmlType::F32) {
        std::memcpy(dst, &value, 4);
      } else {
        const uint16_t h =
            src_type == layout::GgmlType::F16 ? layout::fp32_to_fp16(value) : layout::fp32_to_bf16(value);
        std::memcpy(dst, &h, 2);
      }
    }
  }
  return rows;
}

}  // namespace kvshare::testing
