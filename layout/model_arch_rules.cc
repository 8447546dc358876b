#include "layout/model_arch_rules.h"

#include <cerrno>

namespace kvshare::layout::detail {

Result<void> ArchKeys::read_optional(HparamKey which, uint32_t& value) const {
  KVSHARE_TRY_ASSIGN(auto found, find_u32(which));
  if (found) value = *found;
  return {};
}

Result<void> ArchKeys::read_optional(HparamKey which, float& value) const {
  KVSHARE_TRY_ASSIGN(auto found, find_f32(which));
  if (found) value = *found;
  return {};
}

Result<void> ArchKeys::read_optional(HparamKey which, std::string& value) const {
  if (!metadata_.contains(key(which))) return {};
  KVSHARE_TRY_ASSIGN(value, metadata_.get_string(key(which)));
  return {};
}

namespace {

// Plain attention models: llama_kv_cache over every layer, nothing arch-specific in the
// shape (src/models/llama.cpp, qwen2.cpp, qwen2moe.cpp, qwen3.cpp, qwen3moe.cpp).
Result<void> plain_attention(const ArchKeys&, ModelHparams&) { return {}; }

// M-RoPE (qwen2vl: MROPE, qwen3vl/qwen3vlmoe: IMROPE). get_key_or_arr(rope_sections, 4,
// required): a scalar or an array of exactly 4. llama_hparams::n_pos_per_embd is then 4,
// which widens every cell record of the state file.
Result<void> mrope_sections(const ArchKeys& keys, ModelHparams& hparams) {
  auto sections = keys.per_layer(HparamKey::rope_dimension_sections, 4);
  if (!sections) return fail(sections.error());
  if (!sections->has_value())
    return fail(ENOENT, "key {} is missing: a {} model (M-RoPE) needs it", keys.key(HparamKey::rope_dimension_sections),
                keys.arch());
  hparams.n_pos_per_embd = 4;
  return {};
}

// The period key is read with the scalar get_key_or_arr overload: an array is ignored and
// the default period stays (llama_model_loader::get_key_or_arr(kid, uint32_t&, false)).
Result<void> read_swa_period(const ArchKeys& keys, uint32_t& period) {
  const GgufValue* value = keys.find(HparamKey::attention_sliding_window_pattern);
  if (value == nullptr || value->type() == GgufValueType::ARRAY) return {};
  return keys.read_optional(HparamKey::attention_sliding_window_pattern, period);
}

// src/models/gemma2.cpp: always SWA (window 4096 unless given), period 2.
Result<void> gemma2(const ArchKeys& keys, ModelHparams& hparams) {
  hparams.swa_type = SwaType::standard;
  hparams.n_swa = 4096;
  uint32_t period = 2;
  KVSHARE_TRY(read_swa_period(keys, period));
  hparams.set_swa_pattern(period);
  KVSHARE_TRY(keys.read_optional(HparamKey::attention_sliding_window, hparams.n_swa));
  hparams.memory_kind = MemoryKind::kv_iswa;
  return {};
}

// src/models/gemma3.cpp: SWA only when the window key is present and non-zero, period 6.
Result<void> gemma3(const ArchKeys& keys, ModelHparams& hparams) {
  auto window = keys.find_u32(HparamKey::attention_sliding_window);
  if (!window) return fail(window.error());
  if (window->has_value() && **window > 0) {
    hparams.n_swa = **window;
    hparams.swa_type = SwaType::standard;
    uint32_t period = 6;
    KVSHARE_TRY(read_swa_period(keys, period));
    hparams.set_swa_pattern(period);
    hparams.memory_kind = MemoryKind::kv_iswa;
  }
  return {};
}

Result<void> read_ssm(const ArchKeys& keys, ModelHparams& hparams, bool has_group_count) {
  KVSHARE_TRY_ASSIGN(hparams.ssm_d_conv, keys.u32(HparamKey::ssm_conv_kernel));
  KVSHARE_TRY_ASSIGN(hparams.ssm_d_inner, keys.u32(HparamKey::ssm_inner_size));
  KVSHARE_TRY_ASSIGN(hparams.ssm_d_state, keys.u32(HparamKey::ssm_state_size));
  // Not part of the state's shape, but llama.cpp refuses a model without it.
  KVSHARE_TRY(keys.u32(HparamKey::ssm_time_step_rank));
  if (has_group_count) {
    KVSHARE_TRY_ASSIGN(hparams.ssm_n_group, keys.u32(HparamKey::ssm_group_count));
  }
  return {};
}

// src/models/mamba.cpp, mamba2.cpp: pure recurrent memory over every trunk layer.
Result<void> mamba(const ArchKeys& keys, ModelHparams& hparams) {
  KVSHARE_TRY(read_ssm(keys, hparams, false));
  hparams.memory_kind = MemoryKind::recurrent;
  return {};
}

Result<void> mamba2(const ArchKeys& keys, ModelHparams& hparams) {
  KVSHARE_TRY(read_ssm(keys, hparams, true));
  hparams.memory_kind = MemoryKind::recurrent;
  return {};
}

// Jamba and Granite-hybrid: a layer is recurrent iff its head_count_kv is 0.
void recurrent_where_no_kv_heads(ModelHparams& hparams) {
  for (uint32_t il = 0; il < hparams.n_layer(); ++il) hparams.is_recr[il] = hparams.n_head_kv[il] == 0;
}

Result<void> jamba(const ArchKeys& keys, ModelHparams& hparams) {
  KVSHARE_TRY(read_ssm(keys, hparams, false));
  recurrent_where_no_kv_heads(hparams);
  hparams.memory_kind = MemoryKind::hybrid;
  return {};
}

Result<void> granite_hybrid(const ArchKeys& keys, ModelHparams& hparams) {
  KVSHARE_TRY(read_ssm(keys, hparams, true));
  recurrent_where_no_kv_heads(hparams);
  hparams.memory_kind = MemoryKind::hybrid;
  return {};
}

// src/models/lfm2.cpp: short-conv layers (head_count_kv 0) are recurrent, with a conv
// state only; with a non-zero sliding_window every attention layer is SWA and the memory
// hybrid_iswa.
Result<void> lfm2(const ArchKeys& keys, ModelHparams& hparams) {
  KVSHARE_TRY_ASSIGN(hparams.n_shortconv_l_cache, keys.u32(HparamKey::shortconv_l_cache));
  if (hparams.n_shortconv_l_cache < 2)
    return fail(EINVAL, "key {} is {}: the conv state keeps l_cache - 1 columns, llama.cpp asserts l_cache > 1",
                keys.key(HparamKey::shortconv_l_cache), hparams.n_shortconv_l_cache);
  recurrent_where_no_kv_heads(hparams);
  auto window = keys.find_u32(HparamKey::attention_sliding_window);
  if (!window) return fail(window.error());
  if (window->has_value() && **window > 0) {
    hparams.n_swa = **window;
    hparams.swa_type = SwaType::standard;
    for (uint32_t il = 0; il < hparams.n_layer(); ++il) hparams.is_swa[il] = !hparams.is_recr[il];
  }
  hparams.memory_kind = MemoryKind::hybrid;
  return {};
}

Result<void> read_nextn(const ArchKeys& keys, ModelHparams& hparams) {
  KVSHARE_TRY(keys.read_optional(HparamKey::nextn_predict_layers, hparams.n_layer_nextn));
  if (hparams.n_layer_nextn >= hparams.n_layer_all)
    return fail(EINVAL, "key {} is {}, it must be below block_count ({})", keys.key(HparamKey::nextn_predict_layers),
                hparams.n_layer_nextn, hparams.n_layer_all);
  return {};
}

// src/models/qwen3next.cpp, qwen35.cpp: gated delta net layers are recurrent, from the
// recurrent_layers array or else every layer but each full_attention_interval-th.
Result<void> qwen3next(const ArchKeys& keys, ModelHparams& hparams) {
  KVSHARE_TRY(read_ssm(keys, hparams, true));
  KVSHARE_TRY(read_nextn(keys, hparams));
  auto layers = keys.per_layer(HparamKey::attention_recurrent_layers, hparams.n_layer_all);
  if (!layers) return fail(layers.error());
  if (layers->has_value()) {
    for (uint32_t il = 0; il < hparams.n_layer_all; ++il) hparams.is_recr[il] = (**layers)[il] != 0;
  } else {
    uint32_t interval = 4;
    KVSHARE_TRY(keys.read_optional(HparamKey::full_attention_interval, interval));
    if (interval == 0)
      return fail(EINVAL, "key {} is 0: every layer would be recurrent", keys.key(HparamKey::full_attention_interval));
    for (uint32_t il = 0; il < hparams.n_layer_all; ++il)
      hparams.is_recr[il] = il < hparams.n_layer() && (il + 1) % interval != 0;
  }
  hparams.memory_kind = MemoryKind::hybrid;
  hparams.nextn_in_attention_cache = false;
  return {};
}

Result<void> qwen35(const ArchKeys& keys, ModelHparams& hparams) {
  KVSHARE_TRY(mrope_sections(keys, hparams));
  return qwen3next(keys, hparams);
}

// src/models/deepseek2.cpp: MLA when key_length_mla and value_length_mla are both set; the
// cache then holds only K (latent + rope part, key_length wide).
Result<void> deepseek2(const ArchKeys& keys, ModelHparams& hparams) {
  // The converter already folds kv_lora_rank into key_length; llama.cpp still requires it.
  KVSHARE_TRY(keys.u32(HparamKey::attention_kv_lora_rank));
  KVSHARE_TRY(keys.read_optional(HparamKey::attention_key_length_mla, hparams.n_embd_head_k_mla));
  KVSHARE_TRY(keys.read_optional(HparamKey::attention_value_length_mla, hparams.n_embd_head_v_mla));
  if ((hparams.n_embd_head_k_mla == 0) != (hparams.n_embd_head_v_mla == 0))
    return fail(EINVAL, "keys {} ({}) and {} ({}) must both be set or both be absent",
                keys.key(HparamKey::attention_key_length_mla), hparams.n_embd_head_k_mla,
                keys.key(HparamKey::attention_value_length_mla), hparams.n_embd_head_v_mla);
  KVSHARE_TRY(read_nextn(keys, hparams));
  return {};
}

}  // namespace

const std::vector<ArchEntry>& arch_table() {
  static const std::vector<ArchEntry> table{
      {"llama", plain_attention},
      {"qwen2", plain_attention},
      {"qwen2moe", plain_attention},
      {"qwen3", plain_attention},
      {"qwen3moe", plain_attention},
      {"qwen2vl", mrope_sections},
      {"qwen3vl", mrope_sections},
      {"qwen3vlmoe", mrope_sections},
      {"gemma2", gemma2},
      {"gemma3", gemma3},
      {"mamba", mamba},
      {"mamba2", mamba2},
      {"jamba", jamba},
      {"granitehybrid", granite_hybrid},
      {"qwen3next", qwen3next},
      {"qwen35", qwen35},
      {"qwen35moe", qwen35},
      {"deepseek2", deepseek2},
      {"lfm2", lfm2},
  };
  return table;
}

}  // namespace kvshare::layout::detail
