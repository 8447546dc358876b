// The cache tensors llama.cpp creates for a model and KV params (llama_kv_cache,
// llama_kv_cache_iswa, llama_memory_recurrent, llama_memory_hybrid constructors):
// sizes, owned layers, tensor names, types and shapes, in creation order.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "layout/error.h"
#include "layout/kv_params.h"
#include "layout/model_shape.h"

namespace kvshare::layout {

enum class TensorKind : uint8_t { k, v, r, s };
std::string_view tensor_kind_name(TensorKind kind);

// One memory tensor as ggml creates it (views are not listed: they own no memory).
struct CacheTensor {
  std::string name;    // "cache_k_l3", "cache_v_l3", "cache_r_l0", "cache_s_l0"
  uint32_t layer = 0;  // il
  TensorKind kind = TensorKind::k;
  GgmlType type = GgmlType::F16;
  std::array<int64_t, 4> ne{1, 1, 1, 1};
  uint64_t nbytes = 0;     // ggml_nbytes
  uint64_t row_bytes = 0;  // nb[1]: ggml_row_size(type, ne[0])
};

struct KvCacheLayer {
  uint32_t il = 0;
  uint32_t n_embd_k_gqa = 0;
  uint32_t n_embd_v_gqa = 0;
  bool has_v = true;  // false for MLA
};

// One llama_kv_cache: the plain cache, or the base or SWA half of an iSWA pair.
struct KvCacheShape {
  std::string role;      // "kv", "base" or "swa"
  uint32_t kv_size = 0;  // cells per stream
  uint32_t n_stream = 1;
  GgmlType type_k = GgmlType::F16;
  GgmlType type_v = GgmlType::F16;
  bool v_trans = false;
  uint32_t n_swa = 0;  // 0: nothing is masked when saving
  SwaType swa_type = SwaType::none;
  uint32_t v_width = 0;              // ne[0] of every V tensor when v_trans (widest layer)
  std::vector<KvCacheLayer> layers;  // owned layers, ascending il
  std::vector<CacheTensor> tensors;  // cache_k_l<il>, cache_v_l<il> per owned layer
};

struct RecurrentLayer {
  uint32_t il = 0;
  uint32_t n_embd_r = 0;
  uint32_t n_embd_s = 0;
};

struct RecurrentShape {
  uint32_t rs_size = 1;                // cells: max(1, n_seq_max)
  uint32_t n_layer = 0;                // hparams.n_layer(): written in the state file
  std::vector<RecurrentLayer> layers;  // layers with recurrent tensors, ascending il
  std::vector<CacheTensor> tensors;    // cache_r_l<il>, cache_s_l<il> per layer
};

struct MemoryShape {
  MemoryKind kind = MemoryKind::kv;
  uint32_t n_ctx = 0;  // after padding to 256
  uint32_t n_ctx_seq = 0;
  uint32_t n_pos_per_embd = 1;              // > 1: M-RoPE cells (20-byte state-file cell records)
  std::vector<KvCacheShape> kv_caches;      // state-file order: plain, or base then SWA
  std::optional<RecurrentShape> recurrent;  // after the KV caches in state files
};

// Applies llama.cpp's sizing rules (n_ctx padding, n_ctx_seq, SWA cache size, rs_size).
// Fails on invalid params or a context larger than llama.cpp allows.
Result<MemoryShape> derive_memory_shape(const ModelShape& model, const KvParams& params);

// Bytes one token of KV takes across every KV cache (recurrent state excluded).
uint64_t kv_bytes_per_token(const MemoryShape& memory);

}  // namespace kvshare::layout
