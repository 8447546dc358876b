#include "layout/memory_shape.h"

#include <algorithm>
#include <cerrno>
#include <limits>

#include <fmt/format.h>

namespace kvshare::layout {
namespace {

// GGML_PAD(x, 256): llama_context pads n_ctx and n_ctx_seq, and the SWA cache, to 256.
constexpr uint64_t kCtxPad = 256;
uint64_t pad256(uint64_t value) { return (value + kCtxPad - 1) / kCtxPad * kCtxPad; }

// llama-server's default -b: the micro-batch is min(n_batch, n_ubatch), n_batch min(n_ctx, -b).
constexpr uint32_t kDefaultBatch = 2048;

Result<CacheTensor> make_tensor(std::string name, uint32_t il, TensorKind kind, GgmlType type,
                                std::array<int64_t, 4> ne, std::string_view flag) {
  if (!is_row_aligned(type, ne[0]))
    return fail(EINVAL, "{}: {} is {} elements wide, not a multiple of {}'s block of {} ({})", name,
                tensor_kind_name(kind), ne[0], ggml_type_name(type), ggml_traits(type).block_size, flag);
  CacheTensor t;
  t.name = std::move(name);
  t.layer = il;
  t.kind = kind;
  t.type = type;
  t.ne = ne;
  t.row_bytes = ggml_row_size(type, ne[0]);
  t.nbytes = t.row_bytes * static_cast<uint64_t>(ne[1]) * static_cast<uint64_t>(ne[2]) * static_cast<uint64_t>(ne[3]);
  return t;
}

// The widest n_embd_v_gqa over every layer of the model (llama_hparams::n_embd_v_gqa_max,
// which also counts layers this cache does not own).
uint32_t n_embd_v_gqa_max(const ModelShape& model) {
  uint32_t widest = 0;
  for (const auto& layer : model.layers) widest = std::max(widest, layer.n_embd_v_gqa);
  return widest;
}

// llama_kv_cache's constructor: K then V per owned layer, ascending il.
Result<KvCacheShape> make_kv_cache(const ModelShape& model, const KvParams& params, std::string role, uint32_t kv_size,
                                   uint32_t n_stream, uint32_t n_swa, SwaType swa_type,
                                   bool (*owns)(const LayerShape&)) {
  KvCacheShape cache;
  cache.role = std::move(role);
  cache.kv_size = kv_size;
  cache.n_stream = n_stream;
  cache.type_k = params.type_k;
  cache.type_v = params.type_v;
  cache.v_trans = params.v_trans();
  cache.n_swa = n_swa;
  cache.swa_type = swa_type;
  cache.v_width = cache.v_trans ? n_embd_v_gqa_max(model) : 0;
  for (uint32_t il = 0; il < model.layers.size(); ++il) {
    const LayerShape& layer = model.layers[il];
    if (!layer.has_kv || !owns(layer)) continue;
    const bool has_v = !model.is_mla;
    cache.layers.push_back({il, layer.n_embd_k_gqa, layer.n_embd_v_gqa, has_v});
    auto k = make_tensor(fmt::format("cache_k_l{}", il), il, TensorKind::k, params.type_k,
                         {layer.n_embd_k_gqa, kv_size, n_stream, 1}, "-ctk");
    if (!k) return fail(k.error());
    cache.tensors.push_back(std::move(*k));
    if (!has_v) continue;
    const uint32_t width = cache.v_trans ? cache.v_width : layer.n_embd_v_gqa;
    auto v = make_tensor(fmt::format("cache_v_l{}", il), il, TensorKind::v, params.type_v,
                         {width, kv_size, n_stream, 1}, "-ctv");
    if (!v) return fail(v.error());
    cache.tensors.push_back(std::move(*v));
  }
  return cache;
}

// llama_memory_recurrent's constructor: r then s per recurrent trunk layer, both f32.
Result<RecurrentShape> make_recurrent(const ModelShape& model, const KvParams& params) {
  RecurrentShape rs;
  rs.rs_size = std::max<uint32_t>(1, params.n_seq_max);
  rs.n_layer = model.n_layer;
  for (uint32_t il = 0; il < model.n_layer; ++il) {
    if (!model.layers[il].is_recurrent) continue;
    rs.layers.push_back({il, model.n_embd_r, model.n_embd_s});
    auto r = make_tensor(fmt::format("cache_r_l{}", il), il, TensorKind::r, GgmlType::F32,
                         {model.n_embd_r, rs.rs_size, 1, 1}, "recurrent state");
    if (!r) return fail(r.error());
    rs.tensors.push_back(std::move(*r));
    auto s = make_tensor(fmt::format("cache_s_l{}", il), il, TensorKind::s, GgmlType::F32,
                         {model.n_embd_s, rs.rs_size, 1, 1}, "recurrent state");
    if (!s) return fail(s.error());
    rs.tensors.push_back(std::move(*s));
  }
  return rs;
}

// Checks llama_init_from_model makes against the model (validate() covers the params alone).
Result<void> check_params_against_model(const ModelShape& model, const KvParams& params) {
  if (model.is_mla && params.type_k != params.type_v)
    return fail(EINVAL, "-ctk {} -ctv {}: the {} model uses MLA and needs the same K and V cache types",
                ggml_type_name(params.type_k), ggml_type_name(params.type_v), model.arch);
  if (!params.flash_attn) return {};
  for (uint32_t il = 0; il < model.n_layer; ++il) {
    const LayerShape& layer = model.layers[il];
    if (is_quantized(params.type_k) && !is_row_aligned(params.type_k, layer.n_embd_head_k))
      return fail(EINVAL, "-ctk {}: block size {} does not divide layer {}'s K head size {}",
                  ggml_type_name(params.type_k), ggml_traits(params.type_k).block_size, il, layer.n_embd_head_k);
    if (is_quantized(params.type_v) && !is_row_aligned(params.type_v, layer.n_embd_head_v))
      return fail(EINVAL, "-ctv {}: block size {} does not divide layer {}'s V head size {}",
                  ggml_type_name(params.type_v), ggml_traits(params.type_v).block_size, il, layer.n_embd_head_v);
  }
  return {};
}

}  // namespace

std::string_view tensor_kind_name(TensorKind kind) {
  switch (kind) {
    case TensorKind::k:
      return "k";
    case TensorKind::v:
      return "v";
    case TensorKind::r:
      return "r";
    case TensorKind::s:
      return "s";
  }
  return "unknown";
}

Result<MemoryShape> derive_memory_shape(const ModelShape& model, const KvParams& params) {
  if (auto r = validate(params); !r) return fail(r.error());
  if (auto r = check_params_against_model(model, params); !r) return fail(r.error());

  // llama_context's constructor: -c 0 takes the trained context, then everything pads to 256.
  const uint64_t n_ctx_asked = params.n_ctx == 0 ? model.n_ctx_train : params.n_ctx;
  if (n_ctx_asked == 0) return fail(EINVAL, "-c 0 and the model's context_length is 0: no context size to use");
  uint64_t n_ctx = pad256(n_ctx_asked);
  uint64_t n_ctx_seq = n_ctx;
  const uint32_t n_stream = params.kv_unified ? 1 : params.n_seq_max;
  if (!params.kv_unified) {
    n_ctx_seq = pad256(n_ctx / params.n_seq_max);
    n_ctx = n_ctx_seq * params.n_seq_max;
  }
  if (n_ctx > std::numeric_limits<uint32_t>::max())
    return fail(EOVERFLOW, "-c {} -np {}: the padded context {} does not fit llama.cpp's 32-bit n_ctx", params.n_ctx,
                params.n_seq_max, n_ctx);
  const uint32_t n_ubatch = static_cast<uint32_t>(std::min<uint64_t>({params.n_ubatch, kDefaultBatch, n_ctx_asked}));

  MemoryShape memory;
  memory.kind = model.memory_kind;
  memory.n_ctx = static_cast<uint32_t>(n_ctx);
  memory.n_ctx_seq = static_cast<uint32_t>(n_ctx_seq);
  memory.n_pos_per_embd = model.n_pos_per_embd;
  const uint32_t kv_size = memory.n_ctx_seq;

  auto add_cache = [&](Result<KvCacheShape> cache) -> Result<void> {
    if (!cache) return fail(cache.error());
    memory.kv_caches.push_back(std::move(*cache));
    return {};
  };
  const auto every_layer = [](const LayerShape&) { return true; };
  const auto full_layers = [](const LayerShape& layer) { return !layer.is_swa; };
  const auto swa_layers = [](const LayerShape& layer) { return layer.is_swa; };

  switch (model.memory_kind) {
    case MemoryKind::none:
      break;
    case MemoryKind::kv:
    case MemoryKind::hybrid:
      if (auto r = add_cache(
              make_kv_cache(model, params, "kv", kv_size, n_stream, model.n_swa, model.swa_type, every_layer));
          !r)
        return fail(r.error());
      break;
    case MemoryKind::kv_iswa:
    case MemoryKind::hybrid_iswa: {
      // llama_kv_cache_iswa: the SWA cache holds the window of every sequence plus one
      // micro-batch, padded to 256, unless --swa-full.
      const uint64_t swa_cells = uint64_t{model.n_swa} * (params.kv_unified ? params.n_seq_max : 1) + n_ubatch;
      const uint32_t size_swa =
          params.swa_full ? kv_size : static_cast<uint32_t>(pad256(std::min<uint64_t>(kv_size, swa_cells)));
      if (auto r = add_cache(make_kv_cache(model, params, "base", kv_size, n_stream, 0, SwaType::none, full_layers));
          !r)
        return fail(r.error());
      if (auto r = add_cache(
              make_kv_cache(model, params, "swa", size_swa, n_stream, model.n_swa, model.swa_type, swa_layers));
          !r)
        return fail(r.error());
      break;
    }
    case MemoryKind::recurrent:
      break;
  }
  if (model.memory_kind == MemoryKind::recurrent || model.memory_kind == MemoryKind::hybrid ||
      model.memory_kind == MemoryKind::hybrid_iswa) {
    auto rs = make_recurrent(model, params);
    if (!rs) return fail(rs.error());
    memory.recurrent = std::move(*rs);
  }
  return memory;
}

uint64_t kv_bytes_per_token(const MemoryShape& memory) {
  uint64_t total = 0;
  for (const auto& cache : memory.kv_caches)
    for (const auto& tensor : cache.tensors) total += tensor.row_bytes;
  return total;
}

}  // namespace kvshare::layout
