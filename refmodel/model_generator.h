// kvshare-mkmodel's library: tiny random-weight llama/qwen2/qwen3 GGUF models with a
// byte-level BPE vocabulary and a ChatML template that a stock llama.cpp loads and
// serves. Deterministic: the same options give the same bytes. docs/refmodel.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "layout/error.h"
#include "layout/tensor_type.h"
#include "layout/gguf_writer.h"

namespace kvshare::refmodel {

struct GeneratorOptions {
  std::string arch = "qwen3";  // qwen3, qwen2 or llama
  uint32_t n_layer = 2;
  uint32_t n_embd = 128;
  uint32_t n_head = 4;
  uint32_t n_head_kv = 2;
  uint32_t head_dim = 64;      // key_length = value_length = rope.dimension_count
  uint32_t n_ff = 256;
  uint32_t n_ctx_train = 4096; // {arch}.context_length
  layout::GgmlType wtype = layout::GgmlType::F32;  // 2-D weights: f32, f16, bf16 or q8_0
  uint64_t seed = 1;
  // Multiplies the scale of attn_output and ffn_down, the two projections that write into
  // the residual stream. At 1 the token's own embedding dominates and a tied (qwen3) model
  // greedily repeats the prompt's last token, with wide logit margins; near 3 the reply
  // depends on the whole prompt (attention matters), with margins around 0.3: what a test
  // that must notice wrong KV uses.
  float residual_gain = 1.0f;
  bool shape_only = false;     // metadata and tensor infos, no data section
  // Tied embeddings (no output.weight). Default: tied for qwen3, separate otherwise.
  std::optional<bool> tie_embeddings;
  std::string name;            // general.name; "" -> "kvshare-tiny-<arch>"
};

// Checks the options: arch known, sizes positive, heads divisible, head_dim even, every
// row length a multiple of the weight type's block. Errors name the option.
Result<void> validate(const GeneratorOptions& options);

// The vocabulary every generated model carries (tokenizer.ggml.tokens order).
std::vector<std::string> generated_vocabulary();

// The ChatML template written to tokenizer.chat_template.
const std::string& generated_chat_template();

// A writer holding the whole model; tensor data is produced while writing.
Result<layout::GgufWriter> make_model_writer(const GeneratorOptions& options);

// Writes the model file to `sink` (streams, one tensor at a time).
Result<void> generate_model(const GeneratorOptions& options, const layout::GgufSink& sink);

// The model file in memory (tests, small models).
Result<std::vector<std::byte>> generate_model_bytes(const GeneratorOptions& options);

}  // namespace kvshare::refmodel
