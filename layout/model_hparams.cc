#include "layout/model_hparams.h"

#include <algorithm>
#include <cerrno>

#include <fmt/format.h>

#include "layout/model_arch_rules.h"

namespace kvshare::layout {
namespace {

using detail::ArchKeys;

// LLAMA_MAX_LAYERS: load_hparams asserts block_count is in (0, 512].
constexpr uint32_t kMaxLayers = 512;

Error unsupported_arch(const std::string& arch) {
  const auto key = [&](HparamKey which) { return fmt::format("{}.{}", arch, hparam_key_suffix(which)); };
  return fail(ENOTSUP,
              "model architecture \"{}\" is not supported (supported: {}); adding it needs its cache rules "
              "(llama_model::create_memory) and the keys {}, {}, {}, {}, {}, {}, {}, plus {}* for SWA and "
              "{}.ssm.* for recurrent layers",
              arch, fmt::join(supported_archs(), ", "), key(HparamKey::block_count), key(HparamKey::context_length),
              key(HparamKey::embedding_length), key(HparamKey::attention_head_count),
              key(HparamKey::attention_head_count_kv), key(HparamKey::attention_key_length),
              key(HparamKey::attention_value_length), key(HparamKey::attention_sliding_window), arch)
      .value();
}

// Head sizes default to n_embd / n_head(0); models without attention heads have none.
Result<void> read_head_sizes(const ArchKeys& keys, ModelHparams& h) {
  if (h.n_head[0] > 0) {
    h.n_embd_head_k_full = h.n_embd / h.n_head[0];
    h.n_embd_head_v_full = h.n_embd / h.n_head[0];
    KVSHARE_TRY(keys.read_optional(HparamKey::attention_key_length, h.n_embd_head_k_full));
    KVSHARE_TRY(keys.read_optional(HparamKey::attention_value_length, h.n_embd_head_v_full));
  }
  h.n_embd_head_k_swa = h.n_embd_head_k_full;
  h.n_embd_head_v_swa = h.n_embd_head_v_full;
  KVSHARE_TRY(keys.read_optional(HparamKey::attention_key_length_swa, h.n_embd_head_k_swa));
  KVSHARE_TRY(keys.read_optional(HparamKey::attention_value_length_swa, h.n_embd_head_v_swa));
  return {};
}

// load_hparams' RoPE keys and the RMS epsilon most load_arch_hparams read.
Result<void> read_rope_and_norm(const ArchKeys& keys, ModelHparams& h) {
  h.n_rot = h.n_embd_head_k_full;
  KVSHARE_TRY(keys.read_optional(HparamKey::rope_dimension_count, h.n_rot));
  KVSHARE_TRY(keys.read_optional(HparamKey::rope_freq_base, h.rope_freq_base));
  KVSHARE_TRY(keys.read_optional(HparamKey::rope_scaling_type, h.rope_scaling_type));
  // The factor under its current name, else the old one; 0 (or none) means no scaling.
  float factor = 0.0f;
  for (HparamKey which : {HparamKey::rope_scaling_factor, HparamKey::rope_scale_linear}) {
    KVSHARE_TRY_ASSIGN(auto found, keys.find_f32(which));
    if (found) {
      factor = *found;
      break;
    }
  }
  h.rope_freq_scale = factor == 0.0f ? 1.0f : 1.0f / factor;
  KVSHARE_TRY_ASSIGN(h.rms_eps, keys.find_f32(HparamKey::attention_layernorm_rms_eps));
  return {};
}

// load_hparams up to load_arch_hparams: the keys every arch reads.
Result<ModelHparams> read_common(const ArchKeys& keys) {
  ModelHparams h;
  h.arch = keys.arch();
  KVSHARE_TRY_ASSIGN(h.n_ctx_train, keys.u32(HparamKey::context_length));
  KVSHARE_TRY_ASSIGN(h.n_embd, keys.u32(HparamKey::embedding_length));
  KVSHARE_TRY_ASSIGN(h.n_layer_all, keys.u32(HparamKey::block_count));
  if (h.n_layer_all == 0 || h.n_layer_all > kMaxLayers)
    return fail(EINVAL, "key {} is {}, llama.cpp accepts 1 to {}", keys.key(HparamKey::block_count), h.n_layer_all,
                kMaxLayers);

  // Per-layer arrays are read before any NextN key, so they span every block.
  KVSHARE_TRY_ASSIGN(auto n_ff, keys.per_layer(HparamKey::feed_forward_length, h.n_layer_all));
  h.n_ff = n_ff.value_or(std::vector<uint32_t>(h.n_layer_all, 0));
  KVSHARE_TRY_ASSIGN(auto n_head, keys.per_layer(HparamKey::attention_head_count, h.n_layer_all));
  h.n_head = n_head.value_or(std::vector<uint32_t>(h.n_layer_all, 0));
  KVSHARE_TRY_ASSIGN(auto n_head_kv, keys.per_layer(HparamKey::attention_head_count_kv, h.n_layer_all));
  h.n_head_kv = n_head_kv.value_or(h.n_head);

  KVSHARE_TRY(read_head_sizes(keys, h));
  KVSHARE_TRY(read_rope_and_norm(keys, h));
  h.is_swa.assign(h.n_layer_all, false);
  h.is_recr.assign(h.n_layer_all, false);
  return h;
}

}  // namespace

std::string_view memory_kind_name(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::none:
      return "none";
    case MemoryKind::kv:
      return "kv";
    case MemoryKind::kv_iswa:
      return "kv_iswa";
    case MemoryKind::recurrent:
      return "recurrent";
    case MemoryKind::hybrid:
      return "hybrid";
    case MemoryKind::hybrid_iswa:
      return "hybrid_iswa";
  }
  return "unknown";
}

std::string_view hparam_key_suffix(HparamKey key) {
  switch (key) {
    case HparamKey::context_length:
      return "context_length";
    case HparamKey::embedding_length:
      return "embedding_length";
    case HparamKey::block_count:
      return "block_count";
    case HparamKey::feed_forward_length:
      return "feed_forward_length";
    case HparamKey::attention_head_count:
      return "attention.head_count";
    case HparamKey::attention_head_count_kv:
      return "attention.head_count_kv";
    case HparamKey::attention_key_length:
      return "attention.key_length";
    case HparamKey::attention_value_length:
      return "attention.value_length";
    case HparamKey::attention_key_length_swa:
      return "attention.key_length_swa";
    case HparamKey::attention_value_length_swa:
      return "attention.value_length_swa";
    case HparamKey::attention_layernorm_rms_eps:
      return "attention.layer_norm_rms_epsilon";
    case HparamKey::attention_sliding_window:
      return "attention.sliding_window";
    case HparamKey::attention_sliding_window_pattern:
      return "attention.sliding_window_pattern";
    case HparamKey::attention_recurrent_layers:
      return "attention.recurrent_layers";
    case HparamKey::attention_kv_lora_rank:
      return "attention.kv_lora_rank";
    case HparamKey::attention_key_length_mla:
      return "attention.key_length_mla";
    case HparamKey::attention_value_length_mla:
      return "attention.value_length_mla";
    case HparamKey::rope_dimension_count:
      return "rope.dimension_count";
    case HparamKey::rope_dimension_sections:
      return "rope.dimension_sections";
    case HparamKey::rope_freq_base:
      return "rope.freq_base";
    case HparamKey::rope_scaling_type:
      return "rope.scaling.type";
    case HparamKey::rope_scaling_factor:
      return "rope.scaling.factor";
    case HparamKey::rope_scale_linear:
      return "rope.scale_linear";
    case HparamKey::ssm_conv_kernel:
      return "ssm.conv_kernel";
    case HparamKey::ssm_inner_size:
      return "ssm.inner_size";
    case HparamKey::ssm_state_size:
      return "ssm.state_size";
    case HparamKey::ssm_time_step_rank:
      return "ssm.time_step_rank";
    case HparamKey::ssm_group_count:
      return "ssm.group_count";
    case HparamKey::shortconv_l_cache:
      return "shortconv.l_cache";
    case HparamKey::nextn_predict_layers:
      return "nextn_predict_layers";
    case HparamKey::full_attention_interval:
      return "full_attention_interval";
  }
  return "unknown";
}

std::string ModelHparams::key(HparamKey which) const { return arch + "." + std::string(hparam_key_suffix(which)); }

void ModelHparams::set_swa_pattern(uint32_t period, bool dense_first) {
  for (uint32_t il = 0; il < n_layer_all; ++il) {
    if (il >= n_layer()) {
      is_swa[il] = false;
    } else if (dense_first) {
      is_swa[il] = period == 0 || il % period != 0;
    } else {
      is_swa[il] = period == 0 || il % period < period - 1;
    }
  }
}

Result<std::string> read_model_arch(const GgufMetadata& metadata) {
  return metadata.get_string("general.architecture");
}

const std::vector<std::string_view>& supported_archs() {
  static const std::vector<std::string_view> names = [] {
    std::vector<std::string_view> out;
    for (const auto& entry : detail::arch_table()) out.push_back(entry.name);
    return out;
  }();
  return names;
}

Result<ModelHparams> detail::read_model_hparams_unnamed(const GgufMetadata& metadata) {
  KVSHARE_TRY_ASSIGN(auto arch, read_model_arch(metadata));
  const auto& table = detail::arch_table();
  const auto entry = std::find_if(table.begin(), table.end(), [&](const auto& e) { return e.name == arch; });
  if (entry == table.end()) return fail(unsupported_arch(arch));

  const ArchKeys keys(metadata, arch);
  KVSHARE_TRY_ASSIGN(auto h, read_common(keys));
  KVSHARE_TRY(entry->rule(keys, h));
  // llm_arch_is_recurrent archs start with every layer recurrent.
  if (h.memory_kind == MemoryKind::recurrent) h.is_recr.assign(h.n_layer_all, true);
  if (h.memory_kind == MemoryKind::hybrid && h.swa_type != SwaType::none) h.memory_kind = MemoryKind::hybrid_iswa;
  return h;
}

Result<ModelHparams> read_model_hparams(const GgufMetadata& metadata, std::string_view file_name) {
  auto hparams = detail::read_model_hparams_unnamed(metadata);
  if (!hparams) return fail(hparams.error().with_context(fmt::format("model {}", file_name)));
  return hparams;
}

}  // namespace kvshare::layout
