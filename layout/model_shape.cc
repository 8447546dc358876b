#include "layout/model_shape.h"

#include <algorithm>
#include <cerrno>
#include <limits>

#include <fmt/format.h>

#include "layout/model_arch_rules.h"

namespace kvshare::layout {
namespace {

using detail::ArchKeys;
using detail::HparamsDraft;

// LLAMA_MAX_LAYERS: load_hparams asserts block_count is in (0, 512].
constexpr uint32_t kMaxLayers = 512;

Result<void> unsupported_arch(const std::string& arch) {
  return fail(ENOTSUP,
              "model architecture \"{0}\" is not supported (supported: {1}); adding it needs its cache rules "
              "(llama_model::create_memory) and the keys {0}.block_count, {0}.context_length, "
              "{0}.embedding_length, {0}.attention.head_count, {0}.attention.head_count_kv, "
              "{0}.attention.key_length, {0}.attention.value_length, plus {0}.attention.sliding_window* for SWA "
              "and {0}.ssm.* for recurrent layers",
              arch, fmt::join(supported_archs(), ", "));
}

Result<uint32_t> checked_u32(uint64_t value, std::string_view what, const std::string& arch) {
  if (value > std::numeric_limits<uint32_t>::max())
    return fail(EOVERFLOW, "{} model: {} is {}, more than 32 bits (llama.cpp keeps it in a uint32_t)", arch, what,
                value);
  return static_cast<uint32_t>(value);
}

// load_hparams up to load_arch_hparams: the keys every arch reads.
Result<HparamsDraft> read_common(const ArchKeys& keys) {
  HparamsDraft h;
  auto n_ctx_train = keys.u32("context_length");
  if (!n_ctx_train) return fail(n_ctx_train.error());
  h.n_ctx_train = *n_ctx_train;
  auto n_embd = keys.u32("embedding_length");
  if (!n_embd) return fail(n_embd.error());
  h.n_embd = *n_embd;
  auto n_layer = keys.u32("block_count");
  if (!n_layer) return fail(n_layer.error());
  if (*n_layer == 0 || *n_layer > kMaxLayers)
    return fail(EINVAL, "key {} is {}, llama.cpp accepts 1 to {}", keys.key("block_count"), *n_layer, kMaxLayers);
  h.n_layer_all = *n_layer;

  // Per-layer arrays are read before any NextN key, so they span every block.
  auto n_ff = keys.per_layer("feed_forward_length", h.n_layer_all);
  if (!n_ff) return fail(n_ff.error());
  h.n_ff = n_ff->value_or(std::vector<uint32_t>(h.n_layer_all, 0));
  auto n_head = keys.per_layer("attention.head_count", h.n_layer_all);
  if (!n_head) return fail(n_head.error());
  h.n_head = n_head->value_or(std::vector<uint32_t>(h.n_layer_all, 0));
  auto n_head_kv = keys.per_layer("attention.head_count_kv", h.n_layer_all);
  if (!n_head_kv) return fail(n_head_kv.error());
  h.n_head_kv = n_head_kv->value_or(h.n_head);

  // Head sizes default to n_embd / n_head(0); models without attention heads have none.
  if (h.n_head[0] > 0) {
    h.n_embd_head_k_full = h.n_embd / h.n_head[0];
    h.n_embd_head_v_full = h.n_embd / h.n_head[0];
    if (auto r = keys.read_optional("attention.key_length", h.n_embd_head_k_full); !r) return fail(r.error());
    if (auto r = keys.read_optional("attention.value_length", h.n_embd_head_v_full); !r) return fail(r.error());
  }
  h.n_embd_head_k_swa = h.n_embd_head_k_full;
  h.n_embd_head_v_swa = h.n_embd_head_v_full;
  if (auto r = keys.read_optional("attention.key_length_swa", h.n_embd_head_k_swa); !r) return fail(r.error());
  if (auto r = keys.read_optional("attention.value_length_swa", h.n_embd_head_v_swa); !r) return fail(r.error());

  h.is_swa.assign(h.n_layer_all, false);
  h.is_recr.assign(h.n_layer_all, false);
  return h;
}

// Which layers each cache of the main context holds (create_memory's filters).
void assign_cache_membership(const HparamsDraft& h, ModelShape& shape) {
  for (uint32_t il = 0; il < h.n_layer_all; ++il) {
    LayerShape& layer = shape.layers[il];
    const bool in_trunk = il < h.n_layer();
    switch (h.memory_kind) {
      case MemoryKind::none:
        layer.has_kv = false;
        layer.is_recurrent = false;
        break;
      case MemoryKind::kv:
      case MemoryKind::kv_iswa:
        layer.has_kv = true;
        layer.is_recurrent = false;
        break;
      case MemoryKind::recurrent:
        layer.has_kv = false;
        layer.is_recurrent = in_trunk;
        break;
      case MemoryKind::hybrid:
      case MemoryKind::hybrid_iswa:
        layer.is_recurrent = in_trunk && h.is_recr[il];
        layer.has_kv = !h.is_recr[il] && (in_trunk || h.nextn_in_attention_cache);
        break;
    }
  }
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

const std::vector<std::string_view>& supported_archs() {
  static const std::vector<std::string_view> names = [] {
    std::vector<std::string_view> out;
    for (const auto& entry : detail::arch_table()) out.push_back(entry.name);
    return out;
  }();
  return names;
}

Result<ModelShape> derive_model_shape(const GgufMetadata& metadata) {
  auto arch = metadata.get_string("general.architecture");
  if (!arch) return fail(arch.error());
  const auto& table = detail::arch_table();
  const auto entry = std::find_if(table.begin(), table.end(), [&](const auto& e) { return e.name == *arch; });
  if (entry == table.end()) return fail(unsupported_arch(*arch).error());

  const ArchKeys keys(metadata, *arch);
  auto draft = read_common(keys);
  if (!draft) return fail(draft.error());
  HparamsDraft& h = *draft;
  if (auto r = entry->rule(keys, h); !r) return fail(r.error());
  // llm_arch_is_recurrent archs start with every layer recurrent.
  if (h.memory_kind == MemoryKind::recurrent) h.is_recr.assign(h.n_layer_all, true);
  if (h.memory_kind == MemoryKind::hybrid && h.swa_type != SwaType::none) h.memory_kind = MemoryKind::hybrid_iswa;

  const bool needs_attention = h.memory_kind == MemoryKind::kv || h.memory_kind == MemoryKind::kv_iswa;
  if (needs_attention && h.n_head[0] == 0)
    return fail(EINVAL, "key {} is missing or 0: a {} model needs attention heads to size its KV cache",
                keys.key("attention.head_count"), *arch);

  ModelShape shape;
  shape.arch = *arch;
  shape.n_layer_all = h.n_layer_all;
  shape.n_layer_nextn = h.n_layer_nextn;
  shape.n_layer = h.n_layer();
  shape.n_embd = h.n_embd;
  shape.n_ctx_train = h.n_ctx_train;
  shape.n_swa = h.n_swa;
  shape.swa_type = h.swa_type;
  shape.is_mla = h.n_embd_head_k_mla != 0 && h.n_embd_head_v_mla != 0;
  shape.n_pos_per_embd = h.n_pos_per_embd;
  shape.memory_kind = h.memory_kind;

  // llama_hparams::n_embd_r / n_embd_s: LFM2's short conv keeps n_embd channels, the
  // Mamba-style state (every other arch here) d_inner + 2 n_group d_state.
  const uint64_t conv_rows = h.n_shortconv_l_cache > 0 ? h.n_shortconv_l_cache - 1
                             : h.ssm_d_conv > 0        ? h.ssm_d_conv - 1
                                                       : 0;
  const uint64_t conv_channels =
      h.n_shortconv_l_cache > 0 ? uint64_t{h.n_embd} : uint64_t{h.ssm_d_inner} + 2ull * h.ssm_n_group * h.ssm_d_state;
  auto n_embd_r = checked_u32(conv_rows * conv_channels, "n_embd_r (conv state width)", *arch);
  if (!n_embd_r) return fail(n_embd_r.error());
  auto n_embd_s = checked_u32(uint64_t{h.ssm_d_state} * h.ssm_d_inner, "n_embd_s (ssm state width)", *arch);
  if (!n_embd_s) return fail(n_embd_s.error());
  shape.n_embd_r = *n_embd_r;
  shape.n_embd_s = *n_embd_s;

  shape.layers.resize(h.n_layer_all);
  for (uint32_t il = 0; il < h.n_layer_all; ++il) {
    LayerShape& layer = shape.layers[il];
    layer.n_head = h.n_head[il];
    layer.n_head_kv = h.n_head_kv[il];
    layer.n_ff = h.n_ff[il];
    layer.is_swa = h.is_swa[il];
    layer.is_nextn = il >= h.n_layer();
    layer.n_embd_head_k = layer.is_swa ? h.n_embd_head_k_swa : h.n_embd_head_k_full;
    layer.n_embd_head_v = layer.is_swa ? h.n_embd_head_v_swa : h.n_embd_head_v_full;
    auto k_gqa =
        checked_u32(uint64_t{layer.n_embd_head_k} * layer.n_head_kv, fmt::format("layer {} n_embd_k_gqa", il), *arch);
    if (!k_gqa) return fail(k_gqa.error());
    auto v_gqa =
        checked_u32(uint64_t{layer.n_embd_head_v} * layer.n_head_kv, fmt::format("layer {} n_embd_v_gqa", il), *arch);
    if (!v_gqa) return fail(v_gqa.error());
    layer.n_embd_k_gqa = *k_gqa;
    layer.n_embd_v_gqa = *v_gqa;
  }
  assign_cache_membership(h, shape);
  return shape;
}

}  // namespace kvshare::layout
