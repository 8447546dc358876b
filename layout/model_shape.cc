#include "layout/model_shape.h"

#include <cerrno>
#include <limits>

#include <fmt/format.h>

namespace kvshare::layout {
namespace {

Result<uint32_t> checked_u32(uint64_t value, std::string_view what, const std::string& arch) {
  if (value > std::numeric_limits<uint32_t>::max())
    return fail(EOVERFLOW, "{} model: {} is {}, more than 32 bits (llama.cpp keeps it in a uint32_t)", arch, what,
                value);
  return static_cast<uint32_t>(value);
}

// Which layers each cache of the main context holds (create_memory's filters).
void assign_cache_membership(const ModelHparams& h, ModelShape& shape) {
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

Result<ModelShape> model_shape_from_hparams(const ModelHparams& h) {
  const std::string& arch = h.arch;
  const size_t n_layer_all = h.n_layer_all;
  if (n_layer_all == 0 || h.n_head.size() != n_layer_all || h.n_head_kv.size() != n_layer_all ||
      h.n_ff.size() != n_layer_all || h.is_swa.size() != n_layer_all || h.is_recr.size() != n_layer_all)
    return fail(EINVAL,
                "{} model: the per-layer hyperparameters do not span its {} blocks (read_model_hparams makes them)",
                arch, n_layer_all);
  const bool needs_attention = h.memory_kind == MemoryKind::kv || h.memory_kind == MemoryKind::kv_iswa;
  if (needs_attention && h.n_head[0] == 0)
    return fail(EINVAL, "key {} is missing or 0: a {} model needs attention heads to size its KV cache",
                h.key(HparamKey::attention_head_count), arch);

  ModelShape shape;
  shape.arch = arch;
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
  auto n_embd_r = checked_u32(conv_rows * conv_channels, "n_embd_r (conv state width)", arch);
  if (!n_embd_r) return fail(n_embd_r.error());
  auto n_embd_s = checked_u32(uint64_t{h.ssm_d_state} * h.ssm_d_inner, "n_embd_s (ssm state width)", arch);
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
        checked_u32(uint64_t{layer.n_embd_head_k} * layer.n_head_kv, fmt::format("layer {} n_embd_k_gqa", il), arch);
    if (!k_gqa) return fail(k_gqa.error());
    auto v_gqa =
        checked_u32(uint64_t{layer.n_embd_head_v} * layer.n_head_kv, fmt::format("layer {} n_embd_v_gqa", il), arch);
    if (!v_gqa) return fail(v_gqa.error());
    layer.n_embd_k_gqa = *k_gqa;
    layer.n_embd_v_gqa = *v_gqa;
  }
  assign_cache_membership(h, shape);
  return shape;
}

Result<ModelShape> derive_model_shape(const GgufMetadata& metadata) {
  KVSHARE_TRY_ASSIGN(auto hparams, detail::read_model_hparams_unnamed(metadata));
  return model_shape_from_hparams(hparams);
}

}  // namespace kvshare::layout
