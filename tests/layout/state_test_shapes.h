// Memory shapes built by hand for state-file tests: the models the golden vectors come from
// (docs/state-file.md), without going through GGUF parsing.
#pragma once

#include <cstdint>

#include "layout/memory_shape.h"

namespace kvshare::testing {

// One llama_kv_cache with `n_layer` layers of `n_embd_gqa` K and V elements each.
inline layout::KvCacheShape kv_cache_shape(std::string role, uint32_t n_layer, uint32_t n_embd_gqa,
                                           layout::GgmlType type_k, layout::GgmlType type_v, bool v_trans,
                                           uint32_t kv_size = 512, uint32_t first_il = 0, uint32_t il_step = 1) {
  layout::KvCacheShape cache;
  cache.role = std::move(role);
  cache.kv_size = kv_size;
  cache.type_k = type_k;
  cache.type_v = type_v;
  cache.v_trans = v_trans;
  cache.v_width = n_embd_gqa;
  for (uint32_t i = 0; i < n_layer; ++i)
    cache.layers.push_back(layout::KvCacheLayer{first_il + i * il_step, n_embd_gqa, n_embd_gqa, true});
  return cache;
}

// The worked example: 2 layers, 2 KV heads of 64, one plain cache.
inline layout::MemoryShape dense_shape(layout::GgmlType type_k = layout::GgmlType::F16,
                                       layout::GgmlType type_v = layout::GgmlType::F16, bool v_trans = false,
                                       uint32_t n_layer = 2, uint32_t n_embd_gqa = 128) {
  layout::MemoryShape shape;
  shape.kind = layout::MemoryKind::kv;
  shape.n_ctx = shape.n_ctx_seq = 512;
  shape.kv_caches.push_back(kv_cache_shape("kv", n_layer, n_embd_gqa, type_k, type_v, v_trans));
  return shape;
}

// Gemma-2 shaped: layer 0 sliding (window `n_swa`), layer 1 full, 128-wide K/V.
inline layout::MemoryShape iswa_shape(uint32_t n_swa = 8, bool v_trans = false) {
  layout::MemoryShape shape;
  shape.kind = layout::MemoryKind::kv_iswa;
  shape.n_ctx = shape.n_ctx_seq = 512;
  shape.kv_caches.push_back(
      kv_cache_shape("base", 1, 128, layout::GgmlType::F16, layout::GgmlType::F16, v_trans, 512, 1));
  auto swa = kv_cache_shape("swa", 1, 128, layout::GgmlType::F16, layout::GgmlType::F16, v_trans, 256, 0);
  swa.n_swa = n_swa;
  swa.swa_type = layout::SwaType::standard;
  shape.kv_caches.push_back(swa);
  return shape;
}

inline layout::RecurrentShape recurrent_part(uint32_t n_layer_total, std::vector<uint32_t> layers, uint32_t n_embd_r,
                                             uint32_t n_embd_s) {
  layout::RecurrentShape recurrent;
  recurrent.rs_size = 1;
  recurrent.n_layer = n_layer_total;
  for (uint32_t il : layers) recurrent.layers.push_back(layout::RecurrentLayer{il, n_embd_r, n_embd_s});
  return recurrent;
}

// Mamba: 2 layers, d_inner 128, d_state 16, d_conv 4 -> n_embd_r 384, n_embd_s 2048.
inline layout::MemoryShape mamba_shape() {
  layout::MemoryShape shape;
  shape.kind = layout::MemoryKind::recurrent;
  shape.recurrent = recurrent_part(2, {0, 1}, 384, 2048);
  return shape;
}

// Hybrid: 4 layers, attention on 1 and 3 (64-wide), recurrent on 0 and 2.
inline layout::MemoryShape hybrid_shape(bool v_trans = false) {
  layout::MemoryShape shape;
  shape.kind = layout::MemoryKind::hybrid;
  shape.n_ctx = shape.n_ctx_seq = 512;
  shape.kv_caches.push_back(
      kv_cache_shape("kv", 2, 64, layout::GgmlType::F16, layout::GgmlType::F16, v_trans, 512, 1, 2));
  shape.recurrent = recurrent_part(4, {0, 2}, 96, 256);
  return shape;
}

// LFM2-shaped (the vector tests/data/state-v3-lfm2-hybrid.bin, docs/state-file.md): 4
// layers, attention on 1 and 3 (1 KV head of 64, f16), short-conv layers 0 and 2 with
// n_embd_r 128 (n_embd 64, l_cache 3) and no S state (n_embd_s 0).
inline layout::MemoryShape lfm2_shape() {
  layout::MemoryShape shape;
  shape.kind = layout::MemoryKind::hybrid;
  shape.n_ctx = shape.n_ctx_seq = 512;
  shape.kv_caches.push_back(
      kv_cache_shape("kv", 2, 64, layout::GgmlType::F16, layout::GgmlType::F16, false, 512, 1, 2));
  shape.recurrent = recurrent_part(4, {0, 2}, 128, 0);
  return shape;
}

// Mamba-2: 3 layers, every one recurrent; d_inner 64, d_state 16, 1 group, d_conv 4 ->
// n_embd_r 3 * (64 + 2 * 16) = 288, n_embd_s 16 * 64 = 1024.
inline layout::MemoryShape mamba2_shape() {
  layout::MemoryShape shape;
  shape.kind = layout::MemoryKind::recurrent;
  shape.recurrent = recurrent_part(3, {0, 1, 2}, 288, 1024);
  return shape;
}

}  // namespace kvshare::testing
