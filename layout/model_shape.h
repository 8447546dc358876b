// The memory shape llama.cpp gives a model, derived from GGUF metadata alone
// (llama_model::load_hparams and the per-arch load_arch_hparams, commit d32676d).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "layout/error.h"
#include "layout/gguf_value.h"

namespace kvshare::layout {

enum class SwaType : uint8_t { none, standard, chunked };

// What llama_model::create_memory builds for the arch.
enum class MemoryKind : uint8_t {
  none,         // embedding-only: no memory, the state file is header and tokens
  kv,           // llama_kv_cache
  kv_iswa,      // llama_kv_cache_iswa: base cache + SWA cache
  recurrent,    // llama_memory_recurrent
  hybrid,       // llama_memory_hybrid: attention KV + recurrent
  hybrid_iswa,  // llama_memory_hybrid_iswa
};
std::string_view memory_kind_name(MemoryKind kind);

struct LayerShape {
  uint32_t n_head = 0;
  uint32_t n_head_kv = 0;
  uint32_t n_embd_head_k = 0;  // key_length (or key_length_swa on SWA layers)
  uint32_t n_embd_head_v = 0;
  uint32_t n_embd_k_gqa = 0;  // n_embd_head_k * n_head_kv
  uint32_t n_embd_v_gqa = 0;  // n_embd_head_v * n_head_kv
  uint32_t n_ff = 0;
  bool is_swa = false;
  bool is_recurrent = false;
  bool has_kv = true;     // owns K/V tensors (false past n_layer_kv_from_start)
  bool is_nextn = false;  // an MTP/NextN block past the trunk
};

struct ModelShape {
  std::string arch;          // general.architecture
  uint32_t n_layer_all = 0;  // {arch}.block_count, trunk + NextN
  uint32_t n_layer_nextn = 0;
  uint32_t n_layer = 0;  // trunk: n_layer_all - n_layer_nextn
  uint32_t n_embd = 0;
  uint32_t n_ctx_train = 0;
  std::vector<LayerShape> layers;  // [n_layer_all]

  uint32_t n_swa = 0;
  SwaType swa_type = SwaType::none;
  bool is_mla = false;          // K only (latent), no V tensor
  uint32_t n_pos_per_embd = 1;  // 4 for M-RoPE: state-file cells grow by 8 bytes

  // Recurrent state widths, elements per sequence per recurrent layer (f32).
  uint32_t n_embd_r = 0;
  uint32_t n_embd_s = 0;

  MemoryKind memory_kind = MemoryKind::kv;
};

// Derives the shape. An arch we do not support is an error naming the arch and the keys
// we would need; a wrongly typed or missing key names the key.
Result<ModelShape> derive_model_shape(const GgufMetadata& metadata);

// Archs derive_model_shape supports, for --help texts and error messages.
const std::vector<std::string_view>& supported_archs();

}  // namespace kvshare::layout
