// The transformer's hyperparameters, taken from layout's one read of the metadata, and the
// weights of the llama, qwen2 and qwen3 dense families, loaded the way llama.cpp loads them
// (src/models/{llama,qwen2,qwen3}.cpp load_arch_tensors, commit d32676d).
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

using layout::HparamKey;
using layout::ModelHparams;

Result<uint32_t> uniform_per_layer(const ModelHparams& model, const std::vector<uint32_t>& values, HparamKey key,
                                   std::string_view name) {
  for (uint32_t x : values)
    if (x != values[0])
      return fail(EINVAL,
                  "model {}: key \"{}\" differs between layers ({} and {}); the reference transformer "
                  "supports uniform layers only",
                  name, model.key(key), values[0], x);
  return values[0];
}

Result<void> check_arch(std::string_view arch, std::string_view name) {
  if (arch != "llama" && arch != "qwen2" && arch != "qwen3")
    return fail(EINVAL,
                "model {}: architecture \"{}\" is not supported by the reference transformer "
                "(llama, qwen2, qwen3 are)",
                name, arch);
  return {};
}

}  // namespace

Result<void> check_transformer_arch(const GgufMetadata& md, std::string_view name) {
  auto arch = layout::read_model_arch(md);
  if (!arch) return fail(arch.error().with_context(fmt::format("model {}", name)));
  return check_arch(*arch, name);
}

Result<Hparams> transformer_hparams(const ModelHparams& model, std::string_view name) {
  KVSHARE_TRY(check_arch(model.arch, name));
  Hparams hp;
  hp.arch = model.arch;
  if (hp.arch == "llama") {
    hp.rope_type = RopeType::norm;
  } else if (hp.arch == "qwen2") {
    hp.rope_type = RopeType::neox;
    hp.has_qkv_bias = true;
  } else {
    hp.rope_type = RopeType::neox;
    hp.has_qk_norm = true;
  }
  hp.n_layer = model.n_layer();
  hp.n_embd = model.n_embd;
  hp.n_ctx_train = model.n_ctx_train;
  if (hp.n_embd == 0) return fail(EINVAL, "model {}: key \"{}\" is 0", name, model.key(HparamKey::embedding_length));

  KVSHARE_TRY_ASSIGN(hp.n_ff, uniform_per_layer(model, model.n_ff, HparamKey::feed_forward_length, name));
  if (hp.n_ff == 0)
    return fail(EINVAL, "model {}: key \"{}\" is missing or 0; the reference transformer needs a feed-forward block",
                name, model.key(HparamKey::feed_forward_length));
  KVSHARE_TRY_ASSIGN(hp.n_head, uniform_per_layer(model, model.n_head, HparamKey::attention_head_count, name));
  KVSHARE_TRY_ASSIGN(hp.n_head_kv, uniform_per_layer(model, model.n_head_kv, HparamKey::attention_head_count_kv, name));
  if (hp.n_head == 0)
    return fail(EINVAL, "model {}: key \"{}\" is missing or 0", name, model.key(HparamKey::attention_head_count));
  if (hp.n_head_kv == 0 || hp.n_head % hp.n_head_kv != 0)
    return fail(EINVAL, "model {}: head_count {} must be a positive multiple of head_count_kv {}", name, hp.n_head,
                hp.n_head_kv);

  hp.n_embd_head_k = model.n_embd_head_k_full;
  hp.n_embd_head_v = model.n_embd_head_v_full;
  if (hp.n_embd_head_k == 0 || hp.n_embd_head_k != hp.n_embd_head_v || hp.n_embd_head_k % 2 != 0)
    return fail(EINVAL, "model {}: key_length {} and value_length {} must be equal, even and positive", name,
                hp.n_embd_head_k, hp.n_embd_head_v);
  hp.n_rot = model.n_rot;
  if (hp.n_rot != hp.n_embd_head_k)
    return fail(EINVAL,
                "model {}: rope.dimension_count {} differs from the head size {} (partial rotary "
                "embeddings are not supported)",
                name, hp.n_rot, hp.n_embd_head_k);

  // load_arch_hparams of llama, qwen2 and qwen3 require the epsilon.
  if (!model.rms_eps)
    return fail(ENOENT, "model {}: key \"{}\" is missing", name, model.key(HparamKey::attention_layernorm_rms_eps));
  hp.rms_eps = *model.rms_eps;
  hp.freq_base = model.rope_freq_base;
  // YaRN and LongRoPE change more than the frequencies.
  if (model.rope_scaling_type != "none" && model.rope_scaling_type != "linear")
    return fail(EINVAL,
                "model {}: rope scaling type \"{}\" ({}) is not supported by the reference transformer (none and "
                "linear are)",
                name, model.rope_scaling_type, model.key(HparamKey::rope_scaling_type));
  hp.freq_scale = model.rope_scaling_type == "none" ? 1.0f : model.rope_freq_scale;
  return hp;
}

Result<uint32_t> read_vocab_size(const GgufMetadata& md, std::string_view name) {
  const layout::GgufValue* tokens = md.find("tokenizer.ggml.tokens");
  if (tokens == nullptr || tokens->get_if<layout::GgufArray>() == nullptr)
    return fail(ENOENT, "model {}: key \"tokenizer.ggml.tokens\" is missing (the vocabulary)", name);
  const auto n_vocab = static_cast<uint32_t>(tokens->get_if<layout::GgufArray>()->elements.size());
  if (n_vocab == 0) return fail(EINVAL, "model {}: the vocabulary is empty", name);
  return n_vocab;
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
