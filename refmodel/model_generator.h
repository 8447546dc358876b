// kvshare-mkmodel's library: tiny random-weight GGUF models with a byte-level BPE
// vocabulary and a ChatML template that a stock llama.cpp loads and serves, one arch per
// memory kind: llama, qwen2, qwen3 (KV cache), gemma3 (iSWA), mamba2 (recurrent), lfm2
// and qwen35 (hybrid). Deterministic: the same options give the same bytes.
// docs/refmodel.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "layout/error.h"
#include "layout/gguf_writer.h"
#include "layout/tensor_type.h"

namespace kvshare::refmodel {

struct GeneratorOptions {
  std::string arch = "qwen3";       // one of generator_archs()
  std::optional<uint32_t> n_layer;  // default 2; 4 for qwen35 (3 GDN + 1 attention)
  uint32_t n_embd = 128;
  uint32_t n_head = 4;
  uint32_t n_head_kv = 2;
  uint32_t head_dim = 64;  // key_length = value_length (lfm2: always n_embd / n_head)
  uint32_t n_ff = 256;
  uint32_t n_ctx_train = 4096;                     // {arch}.context_length
  layout::GgmlType wtype = layout::GgmlType::F32;  // 2-D weights: f32, f16, bf16 or q8_0
  uint64_t seed = 1;
  // Multiplies the scale of attn_output and ffn_down, the two projections that write into
  // the residual stream (and ssm_out, shortconv.out_proj; for gemma3 its post-norms). At 1
  // the token's own embedding dominates and a tied (qwen3, gemma3) model greedily repeats
  // the prompt's last token, with wide logit margins; near 3 the reply depends on the whole
  // prompt (attention matters), with margins around 0.3: what a test that must notice wrong
  // KV uses.
  float residual_gain = 1.0f;
  bool shape_only = false;  // metadata and tensor infos, no data section
  // Tied embeddings (no output.weight). Default: tied for qwen3 and gemma3, separate
  // otherwise (mamba2, lfm2, qwen35: with the control tokens' rows zero).
  std::optional<bool> tie_embeddings;
  std::string name;  // general.name; "" -> "kvshare-tiny-<arch>"

  // gemma3: attention.sliding_window; sliding_window_pattern is 2 (even layers SWA).
  uint32_t n_swa = 32;
  // Recurrent parts. mamba2: d_inner = 2 * n_embd, ssm_n_head heads of d_inner / ssm_n_head,
  // ssm_n_group groups (default 1). qwen35 Gated DeltaNet: ssm_n_head value heads and
  // ssm_n_group key heads (default 2), both ssm_d_state wide. lfm2: ssm_d_conv is
  // shortconv.l_cache; no other ssm key applies.
  uint32_t ssm_d_conv = 4;
  uint32_t ssm_d_state = 16;
  uint32_t ssm_n_head = 4;
  std::optional<uint32_t> ssm_n_group;
  // lfm2 and qwen35: every attn_every-th layer is attention, the others recurrent
  // (default 2 for lfm2: conv, attention, ...; 4 for qwen35, its full_attention_interval).
  std::optional<uint32_t> attn_every;
};

// The archs make_model_writer knows, in --help order.
const std::vector<std::string>& generator_archs();

// Checks the options: arch known, sizes positive, heads divisible, head_dim even, every
// row length a multiple of the weight type's block, and what the arch needs (a hybrid has
// an attention and a recurrent layer, ...). Errors name the option.
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
