// What a loaded model holds inside refmodel: the transformer's hyperparameters (taken from
// layout::read_model_hparams, the one read of the metadata) and weights dequantized to f32.
// Shared by the loader, the forward pass and the tests; not part of the engine contract.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "layout/error.h"
#include "layout/gguf_value.h"
#include "layout/model_hparams.h"
#include "layout/tensor_type.h"
#include "refmodel/engine.h"

namespace kvshare::refmodel {

// llama.cpp's rope types: NORM rotates adjacent pairs (x[2i], x[2i+1]), NEOX rotates
// (x[i], x[i + n_rot/2]) (ggml_rope_ext, mode 0 vs GGML_ROPE_TYPE_NEOX).
enum class RopeType : uint8_t { norm, neox };

struct Hparams {
  std::string arch;  // "llama", "qwen2" or "qwen3"
  uint32_t n_layer = 0;
  uint32_t n_embd = 0;
  uint32_t n_head = 0;
  uint32_t n_head_kv = 0;
  uint32_t n_embd_head_k = 0;
  uint32_t n_embd_head_v = 0;
  uint32_t n_ff = 0;
  uint32_t n_vocab = 0;
  uint32_t n_rot = 0;
  uint32_t n_ctx_train = 0;
  float rms_eps = 1e-6f;
  float freq_base = 10000.0f;
  float freq_scale = 1.0f;  // 1 / rope.scaling.factor for linear scaling
  RopeType rope_type = RopeType::norm;
  bool has_qk_norm = false;   // qwen3: per-head RMSNorm of q and k before RoPE
  bool has_qkv_bias = false;  // qwen2: biases on q, k, v

  uint32_t n_embd_q() const { return n_head * n_embd_head_k; }
  uint32_t n_embd_k_gqa() const { return n_head_kv * n_embd_head_k; }
  uint32_t n_embd_v_gqa() const { return n_head_kv * n_embd_head_v; }
};

// Refuses an arch the transformer does not run, naming it and the ones it does. Checked
// before layout reads the rest: its message beats one about a key another arch needs.
Result<void> check_transformer_arch(const layout::GgufMetadata& metadata, std::string_view name);

// The transformer's hyperparameters from `model`. `name` labels messages, which name the
// key or the unsupported value: layers that differ, partial rotary embeddings, a missing
// RMS epsilon, a rope scaling type other than none and linear. n_vocab is left 0.
Result<Hparams> transformer_hparams(const layout::ModelHparams& model, std::string_view name);

// The vocabulary's size, tokenizer.ggml.tokens' length: the tokenizer's key, not a
// hyperparameter llama_hparams holds.
Result<uint32_t> read_vocab_size(const layout::GgufMetadata& metadata, std::string_view name);

// A weight matrix as ggml stores it: `rows` = ne[1] output features, `cols` = ne[0]
// input features, row-major f32. `type` is the file's type: ggml-cpu rounds the
// activations it multiplies by it (round_like_vec_dot).
struct Matrix {
  int64_t rows = 0;
  int64_t cols = 0;
  layout::GgmlType type = layout::GgmlType::F32;
  std::vector<float> data;  // [rows][cols]
};

struct LayerWeights {
  std::vector<float> attn_norm;  // [n_embd]
  Matrix wq, wk, wv, wo;
  std::vector<float> bq, bk, bv;      // qwen2 (empty when absent)
  std::vector<float> q_norm, k_norm;  // qwen3: [n_embd_head_k]
  std::vector<float> ffn_norm;        // [n_embd]
  Matrix ffn_gate, ffn_up, ffn_down;
};

struct Weights {
  Matrix tok_embd;  // [n_vocab][n_embd]
  std::vector<float> output_norm;
  Matrix output;                  // empty (rows == 0) when tied to tok_embd
  std::vector<float> rope_freqs;  // llama 3 frequency factors [n_rot/2]; empty when absent
  std::vector<LayerWeights> layers;

  const Matrix& lm_head() const { return output.rows > 0 ? output : tok_embd; }
};

// A tensor's bytes: finds tensor info `name`, checks type and shape, returns its data.
using TensorLookup = std::function<Result<std::span<const std::byte>>(const layout::GgufTensorInfo&)>;

// Loads and dequantizes every tensor the arch needs, checking each shape against
// `hparams`. Errors name the tensor: missing, wrong shape (expected and actual), an
// unsupported type, or data the image does not hold.
Result<Weights> load_weights(const Hparams& hparams, const std::vector<layout::GgufTensorInfo>& tensors,
                             const TensorLookup& data_of, std::string_view name);

class Tokenizer;

// The concrete model behind Model.
class LoadedModel final : public Model {
 public:
  LoadedModel(layout::GgufMetadata metadata, std::vector<layout::GgufTensorInfo> tensors, layout::ModelShape shape,
              Hparams hparams, Weights weights, std::unique_ptr<Tokenizer> tokenizer, std::string chat_template,
              std::shared_ptr<void> keep_alive);
  const layout::GgufMetadata& metadata() const override { return metadata_; }
  const std::vector<layout::GgufTensorInfo>& tensor_infos() const override { return tensors_; }
  const layout::ModelShape& shape() const override { return shape_; }
  const Tokenizer& tokenizer() const override { return *tokenizer_; }
  Result<std::string> apply_chat_template(const std::vector<ChatMessage>& messages,
                                          bool add_generation_prompt) const override;

  const Hparams& hparams() const { return hparams_; }
  const Weights& weights() const { return weights_; }

 private:
  layout::GgufMetadata metadata_;
  std::vector<layout::GgufTensorInfo> tensors_;
  layout::ModelShape shape_;
  Hparams hparams_;
  Weights weights_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::string chat_template_;
  std::shared_ptr<void> keep_alive_;
};

}  // namespace kvshare::refmodel
