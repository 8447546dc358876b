// A model's hyperparameters, read once from GGUF metadata as llama_model::load_hparams and
// the per-arch load_arch_hparams read them (src/models/<arch>.cpp, commit d32676d). The
// model shape (model_shape.h) and the reference transformer (refmodel/) both take their
// numbers from this one read, so they cannot disagree about a key or its default.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
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

// The "{arch}.<suffix>" keys we read, named after llama.cpp's LLM_KV_* (src/llama-arch.cpp).
// hparam_key_suffix is the one place a key's spelling lives.
enum class HparamKey : uint8_t {
  context_length,
  embedding_length,
  block_count,
  feed_forward_length,
  attention_head_count,
  attention_head_count_kv,
  attention_key_length,
  attention_value_length,
  attention_key_length_swa,
  attention_value_length_swa,
  attention_layernorm_rms_eps,
  attention_sliding_window,
  attention_sliding_window_pattern,
  attention_recurrent_layers,
  attention_kv_lora_rank,
  attention_key_length_mla,
  attention_value_length_mla,
  rope_dimension_count,
  rope_dimension_sections,
  rope_freq_base,
  rope_scaling_type,
  rope_scaling_factor,
  rope_scale_linear,
  ssm_conv_kernel,
  ssm_inner_size,
  ssm_state_size,
  ssm_time_step_rank,
  ssm_group_count,
  shortconv_l_cache,
  nextn_predict_layers,
  full_attention_interval,
};
std::string_view hparam_key_suffix(HparamKey key);

// llama_hparams as far as kvshare needs it. Per-layer values span every block, NextN
// blocks included.
struct ModelHparams {
  std::string arch;          // general.architecture
  uint32_t n_layer_all = 0;  // block_count: trunk + NextN
  uint32_t n_layer_nextn = 0;
  uint32_t n_embd = 0;
  uint32_t n_ctx_train = 0;
  std::vector<uint32_t> n_head;     // [n_layer_all], 0 when head_count is absent
  std::vector<uint32_t> n_head_kv;  // [n_layer_all], head_count when head_count_kv is absent
  std::vector<uint32_t> n_ff;       // [n_layer_all], 0 when feed_forward_length is absent
  uint32_t n_embd_head_k_full = 0;  // key_length, default n_embd / n_head[0]
  uint32_t n_embd_head_v_full = 0;
  uint32_t n_embd_head_k_swa = 0;  // key_length_swa, default the full-attention size
  uint32_t n_embd_head_v_swa = 0;
  std::vector<bool> is_swa;   // [n_layer_all]
  std::vector<bool> is_recr;  // [n_layer_all]
  uint32_t n_swa = 0;
  SwaType swa_type = SwaType::none;
  uint32_t n_embd_head_k_mla = 0;
  uint32_t n_embd_head_v_mla = 0;
  uint32_t ssm_d_conv = 0;
  uint32_t ssm_d_inner = 0;
  uint32_t ssm_d_state = 0;
  uint32_t ssm_n_group = 0;
  uint32_t n_shortconv_l_cache = 0;  // LFM2: conv state of l_cache - 1 columns, no ssm state
  uint32_t n_pos_per_embd = 1;
  MemoryKind memory_kind = MemoryKind::kv;
  // Hybrid Qwen3-Next/3.5: NextN blocks are in neither cache of the main context
  // (create_memory's filter_attn and filter_recr both require il < n_layer()).
  bool nextn_in_attention_cache = true;

  // RoPE and normalisation, read for every arch as load_hparams does.
  // rope.dimension_count; absent: the head size. llama.cpp defaults to n_embd / n_head and
  // then requires the head size for the dense archs, so a model both accept reads the same.
  uint32_t n_rot = 0;
  float rope_freq_base = 10000.0f;           // rope.freq_base (rope_freq_base_train)
  std::string rope_scaling_type = "linear";  // rope.scaling.type, llama.cpp's default
  // 1 / rope.scaling.factor (else 1 / rope.scale_linear); 1 when absent or 0
  // (rope_freq_scale_train).
  float rope_freq_scale = 1.0f;
  // attention.layer_norm_rms_epsilon: llama.cpp's dense archs require it, the shape does not.
  std::optional<float> rms_eps;

  uint32_t n_layer() const { return n_layer_all - n_layer_nextn; }
  // The full key name, "{arch}.<suffix>", as messages must spell it.
  std::string key(HparamKey which) const;
  // llama_hparams::set_swa_pattern: trunk layers only, NextN layers never SWA.
  void set_swa_pattern(uint32_t period, bool dense_first = false);
};

// general.architecture, strictly a string.
Result<std::string> read_model_arch(const GgufMetadata& metadata);

// Reads every hyperparameter of `metadata`. Errors start with "model <file_name>: " and
// name the key: missing, wrongly typed, out of range, or an arch we do not support
// (ENOTSUP, naming the arch and the keys a port would need).
Result<ModelHparams> read_model_hparams(const GgufMetadata& metadata, std::string_view file_name);

// Archs read_model_hparams supports, in a stable order, for --help texts and messages.
const std::vector<std::string_view>& supported_archs();

namespace detail {
// read_model_hparams without the file: for derive_model_shape, whose callers name it.
Result<ModelHparams> read_model_hparams_unnamed(const GgufMetadata& metadata);
}  // namespace detail

}  // namespace kvshare::layout
