// Hyperparameters and weights of the llama, qwen2 and qwen3 dense families, read the way
// llama.cpp reads them (llama_model::load_hparams, src/models/{llama,qwen2,qwen3}.cpp
// load_arch_tensors, commit d32676d).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "refmodel/model_impl.h"
#include "refmodel/quant.h"

namespace kvshare::refmodel {
namespace {

using layout::GgmlType;
using layout::GgufMetadata;
using layout::GgufTensorInfo;

Result<uint32_t> uniform_per_layer(const GgufMetadata& md, const std::string& key, uint32_t n_layer,
                                   std::optional<uint32_t> fallback, std::string_view name) {
  auto values = md.find_per_layer(key, n_layer);
  if (!values) return fail(values.error().with_context(fmt::format("model {}", name)));
  if (!*values) {
    if (fallback) return *fallback;
    return fail(ENOENT, "model {}: key \"{}\" is missing", name, key);
  }
  const auto& v = **values;
  if (v.empty()) return fail(EINVAL, "model {}: key \"{}\" is empty", name, key);
  for (uint32_t x : v)
    if (x != v[0])
      return fail(EINVAL,
                  "model {}: key \"{}\" differs between layers ({} and {}); the reference transformer "
                  "supports uniform layers only",
                  name, key, v[0], x);
  return v[0];
}

Result<uint32_t> required_u32(const GgufMetadata& md, const std::string& key, std::string_view name) {
  auto v = md.get_u32(key);
  if (!v) return fail(v.error().with_context(fmt::format("model {}", name)));
  return *v;
}

}  // namespace

Result<Hparams> read_hparams(const GgufMetadata& md, std::string_view name) {
  Hparams hp;
  auto arch = md.get_string("general.architecture");
  if (!arch) return fail(arch.error().with_context(fmt::format("model {}", name)));
  hp.arch = *arch;
  if (hp.arch == "llama") {
    hp.rope_type = RopeType::norm;
  } else if (hp.arch == "qwen2") {
    hp.rope_type = RopeType::neox;
    hp.has_qkv_bias = true;
  } else if (hp.arch == "qwen3") {
    hp.rope_type = RopeType::neox;
    hp.has_qk_norm = true;
  } else {
    return fail(EINVAL,
                "model {}: architecture \"{}\" is not supported by the reference transformer "
                "(llama, qwen2, qwen3 are)",
                name, hp.arch);
  }
  const std::string a = hp.arch + ".";
  auto n_layer = required_u32(md, a + "block_count", name);
  if (!n_layer) return fail(n_layer.error());
  hp.n_layer = *n_layer;
  auto n_embd = required_u32(md, a + "embedding_length", name);
  if (!n_embd) return fail(n_embd.error());
  hp.n_embd = *n_embd;
  auto n_ctx = required_u32(md, a + "context_length", name);
  if (!n_ctx) return fail(n_ctx.error());
  hp.n_ctx_train = *n_ctx;
  if (hp.n_layer == 0 || hp.n_embd == 0)
    return fail(EINVAL, "model {}: block_count {} and embedding_length {} must be positive", name, hp.n_layer,
                hp.n_embd);

  auto n_ff = uniform_per_layer(md, a + "feed_forward_length", hp.n_layer, std::nullopt, name);
  if (!n_ff) return fail(n_ff.error());
  hp.n_ff = *n_ff;
  auto n_head = uniform_per_layer(md, a + "attention.head_count", hp.n_layer, std::nullopt, name);
  if (!n_head) return fail(n_head.error());
  hp.n_head = *n_head;
  auto n_head_kv = uniform_per_layer(md, a + "attention.head_count_kv", hp.n_layer, hp.n_head, name);
  if (!n_head_kv) return fail(n_head_kv.error());
  hp.n_head_kv = *n_head_kv;
  if (hp.n_head == 0 || hp.n_head_kv == 0 || hp.n_head % hp.n_head_kv != 0)
    return fail(EINVAL, "model {}: head_count {} must be a positive multiple of head_count_kv {}", name, hp.n_head,
                hp.n_head_kv);

  auto key_length = md.find_u32(a + "attention.key_length");
  if (!key_length) return fail(key_length.error().with_context(fmt::format("model {}", name)));
  auto value_length = md.find_u32(a + "attention.value_length");
  if (!value_length) return fail(value_length.error().with_context(fmt::format("model {}", name)));
  const uint32_t default_head = hp.n_embd / hp.n_head;
  hp.n_embd_head_k = key_length->value_or(default_head);
  hp.n_embd_head_v = value_length->value_or(default_head);
  if (hp.n_embd_head_k == 0 || hp.n_embd_head_k != hp.n_embd_head_v || hp.n_embd_head_k % 2 != 0)
    return fail(EINVAL, "model {}: key_length {} and value_length {} must be equal, even and positive", name,
                hp.n_embd_head_k, hp.n_embd_head_v);

  auto rot = md.find_u32(a + "rope.dimension_count");
  if (!rot) return fail(rot.error().with_context(fmt::format("model {}", name)));
  hp.n_rot = rot->value_or(hp.n_embd_head_k);
  if (hp.n_rot != hp.n_embd_head_k)
    return fail(EINVAL,
                "model {}: rope.dimension_count {} differs from the head size {} (partial rotary "
                "embeddings are not supported)",
                name, hp.n_rot, hp.n_embd_head_k);

  auto eps = md.get_f32(a + "attention.layer_norm_rms_epsilon");
  if (!eps) return fail(eps.error().with_context(fmt::format("model {}", name)));
  hp.rms_eps = *eps;
  auto base = md.find_f32(a + "rope.freq_base");
  if (!base) return fail(base.error().with_context(fmt::format("model {}", name)));
  hp.freq_base = base->value_or(10000.0f);

  // llama_model::load_hparams: the scaling type defaults to "linear" and a factor of 0
  // (absent) means no scaling. YaRN and LongRoPE change more than the frequencies.
  std::string scaling = "linear";
  if (md.contains(a + "rope.scaling.type")) {
    auto s = md.get_string(a + "rope.scaling.type");
    if (!s) return fail(s.error().with_context(fmt::format("model {}", name)));
    scaling = *s;
  }
  if (scaling != "none" && scaling != "linear")
    return fail(EINVAL,
                "model {}: rope scaling type \"{}\" ({}rope.scaling.type) is not supported by the "
                "reference transformer (none and linear are)",
                name, scaling, a);
  float factor = 0.0f;
  for (const char* key : {"rope.scaling.factor", "rope.scale_linear"}) {
    auto f = md.find_f32(a + key);
    if (!f) return fail(f.error().with_context(fmt::format("model {}", name)));
    if (*f) {
      factor = **f;
      break;
    }
  }
  hp.freq_scale = (factor == 0.0f || scaling == "none") ? 1.0f : 1.0f / factor;

  const layout::GgufValue* tokens = md.find("tokenizer.ggml.tokens");
  if (tokens == nullptr || tokens->get_if<layout::GgufArray>() == nullptr)
    return fail(ENOENT, "model {}: key \"tokenizer.ggml.tokens\" is missing (the vocabulary)", name);
  hp.n_vocab = static_cast<uint32_t>(tokens->get_if<layout::GgufArray>()->elements.size());
  if (hp.n_vocab == 0) return fail(EINVAL, "model {}: the vocabulary is empty", name);
  return hp;
}

namespace {

struct Loader {
  const std::vector<GgufTensorInfo>& tensors;
  const TensorLookup& data_of;
  std::string_view name;

  const GgufTensorInfo* find(const std::string& tensor) const {
    for (const auto& t : tensors)
      if (t.name == tensor) return &t;
    return nullptr;
  }

  // ne0 x ne1 (ne1 == 0 for a 1-D tensor).
  Result<std::vector<float>> load(const std::string& tensor, int64_t ne0, int64_t ne1, GgmlType* type_out,
                                  bool optional = false, bool* found = nullptr) const {
    const GgufTensorInfo* info = find(tensor);
    if (found) *found = info != nullptr;
    if (info == nullptr) {
      if (optional) return std::vector<float>{};
      return fail(ENOENT, "model {}: tensor \"{}\" is missing", name, tensor);
    }
    const std::array<int64_t, 4> want{ne0, ne1 == 0 ? 1 : ne1, 1, 1};
    if (info->ne != want)
      return fail(EINVAL, "model {}: tensor \"{}\" has shape [{}, {}, {}, {}], expected [{}, {}, {}, {}]", name, tensor,
                  info->ne[0], info->ne[1], info->ne[2], info->ne[3], want[0], want[1], want[2], want[3]);
    if (!is_supported_weight_type(info->type))
      return fail(EINVAL,
                  "model {}: tensor \"{}\" has type {}, not supported (f32, f16, bf16, q8_0, q4_0, q4_K, q6_K are)",
                  name, tensor, layout::ggml_type_name(info->type));
    auto bytes = data_of(*info);
    if (!bytes) return fail(bytes.error().with_context(fmt::format("model {}", name)));
    const int64_t n = want[0] * want[1];
    if (bytes->size() < layout::ggml_row_size(info->type, want[0]) * static_cast<uint64_t>(want[1]))
      return fail(EINVAL, "model {}: tensor \"{}\" data is {} bytes, too short for its shape", name, tensor,
                  bytes->size());
    std::vector<float> out(static_cast<size_t>(n));
    const uint64_t row_bytes = layout::ggml_row_size(info->type, want[0]);
    for (int64_t r = 0; r < want[1]; ++r) {
      auto ok = dequantize_weights(info->type, bytes->data() + r * row_bytes, out.data() + r * want[0], want[0]);
      if (!ok) return fail(ok.error().with_context(fmt::format("model {}: tensor \"{}\"", name, tensor)));
    }
    if (type_out) *type_out = info->type;
    return out;
  }

  Result<Matrix> matrix(const std::string& tensor, int64_t cols, int64_t rows, bool optional = false) const {
    Matrix m;
    bool found = false;
    auto data = load(tensor, cols, rows, &m.type, optional, &found);
    if (!data) return fail(data.error());
    if (!found) return m;
    m.rows = rows;
    m.cols = cols;
    m.data = std::move(*data);
    return m;
  }

  Result<std::vector<float>> vec(const std::string& tensor, int64_t n, bool optional = false) const {
    return load(tensor, n, 0, nullptr, optional);
  }
};

}  // namespace

Result<Weights> load_weights(const Hparams& hp, const std::vector<GgufTensorInfo>& tensors, const TensorLookup& data_of,
                             std::string_view name) {
  Loader ld{tensors, data_of, name};
  Weights w;
  KVSHARE_TRY_ASSIGN(w.tok_embd, ld.matrix("token_embd.weight", hp.n_embd, hp.n_vocab));
  KVSHARE_TRY_ASSIGN(w.output_norm, ld.vec("output_norm.weight", hp.n_embd));
  KVSHARE_TRY_ASSIGN(w.output, ld.matrix("output.weight", hp.n_embd, hp.n_vocab, /*optional=*/true));
  KVSHARE_TRY_ASSIGN(w.rope_freqs, ld.vec("rope_freqs.weight", hp.n_rot / 2, /*optional=*/true));
  w.layers.resize(hp.n_layer);
  for (uint32_t il = 0; il < hp.n_layer; ++il) {
    auto& L = w.layers[il];
    const std::string p = fmt::format("blk.{}.", il);
    KVSHARE_TRY_ASSIGN(L.attn_norm, ld.vec(p + "attn_norm.weight", hp.n_embd));
    KVSHARE_TRY_ASSIGN(L.wq, ld.matrix(p + "attn_q.weight", hp.n_embd, hp.n_embd_q()));
    KVSHARE_TRY_ASSIGN(L.wk, ld.matrix(p + "attn_k.weight", hp.n_embd, hp.n_embd_k_gqa()));
    KVSHARE_TRY_ASSIGN(L.wv, ld.matrix(p + "attn_v.weight", hp.n_embd, hp.n_embd_v_gqa()));
    KVSHARE_TRY_ASSIGN(L.wo, ld.matrix(p + "attn_output.weight", hp.n_head * hp.n_embd_head_v, hp.n_embd));
    // llama.cpp: qwen2 requires the q/k/v biases; llama takes them when present.
    const bool bias_optional = !hp.has_qkv_bias;
    KVSHARE_TRY_ASSIGN(L.bq, ld.vec(p + "attn_q.bias", hp.n_embd_q(), bias_optional));
    KVSHARE_TRY_ASSIGN(L.bk, ld.vec(p + "attn_k.bias", hp.n_embd_k_gqa(), bias_optional));
    KVSHARE_TRY_ASSIGN(L.bv, ld.vec(p + "attn_v.bias", hp.n_embd_v_gqa(), bias_optional));
    if (hp.has_qk_norm) {
      KVSHARE_TRY_ASSIGN(L.q_norm, ld.vec(p + "attn_q_norm.weight", hp.n_embd_head_k));
      KVSHARE_TRY_ASSIGN(L.k_norm, ld.vec(p + "attn_k_norm.weight", hp.n_embd_head_k));
    }
    KVSHARE_TRY_ASSIGN(L.ffn_norm, ld.vec(p + "ffn_norm.weight", hp.n_embd));
    KVSHARE_TRY_ASSIGN(L.ffn_gate, ld.matrix(p + "ffn_gate.weight", hp.n_embd, hp.n_ff));
    KVSHARE_TRY_ASSIGN(L.ffn_up, ld.matrix(p + "ffn_up.weight", hp.n_embd, hp.n_ff));
    KVSHARE_TRY_ASSIGN(L.ffn_down, ld.matrix(p + "ffn_down.weight", hp.n_ff, hp.n_embd));
  }
  return w;
}

}  // namespace kvshare::refmodel
