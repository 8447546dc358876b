// The contract between the CPU reference transformer and its two users, the reference
// provider (kvshare-prefill) and the reference decoder (kvshare-decoder). refmodel knows
// layout/ and never fds: models come in as mapped bytes, the KV cache as spans of memory
// laid out by share_layout (a kvshare region or a plain buffer).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "layout/error.h"
#include "layout/gguf_value.h"
#include "layout/kv_params.h"
#include "layout/memory_shape.h"
#include "layout/model_shape.h"
#include "layout/share_layout.h"

namespace kvshare::refmodel {

// Byte-level BPE (GPT-2 byte mapping, merges by rank) as llama.cpp's llm_tokenizer_bpe does
// for the vocabularies kvshare-mkmodel generates.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // false when this vocabulary's text tokenization cannot be matched exactly; callers
  // then accept token ids only and say so.
  virtual bool supports_text() const = 0;
  virtual Result<std::vector<int32_t>> tokenize(std::string_view text, bool add_special, bool parse_special) const = 0;
  // The bytes of one token (may be a partial UTF-8 sequence).
  virtual std::string token_to_piece(int32_t id) const = 0;
  virtual std::string detokenize(std::span<const int32_t> ids) const = 0;
  virtual int32_t n_vocab() const = 0;
  virtual int32_t bos_id() const = 0;  // -1 when none
  virtual int32_t eos_id() const = 0;  // -1 when none
  virtual bool add_bos() const = 0;
  virtual bool is_end_of_generation(int32_t id) const = 0;  // eos, eot, <|im_end|>
};

struct ChatMessage {
  std::string role;
  std::string content;
};

// A loaded model: weights (dequantized or kept quantized as the implementation likes),
// hyperparameters, tokenizer, chat template.
class Model {
 public:
  virtual ~Model() = default;
  // Parses a GGUF image that stays mapped while the model lives (`keep_alive` owns it).
  // Unknown arch, missing tensor, wrong shape, unsupported rope scaling: errors naming them.
  static Result<std::shared_ptr<const Model>> from_gguf(std::span<const std::byte> gguf_bytes,
                                                        std::shared_ptr<void> keep_alive, std::string_view name);
  virtual const layout::GgufMetadata& metadata() const = 0;
  virtual const std::vector<layout::GgufTensorInfo>& tensor_infos() const = 0;
  virtual const layout::ModelShape& shape() const = 0;
  virtual const Tokenizer& tokenizer() const = 0;
  // The ChatML rendering llama-server's /apply-template gives for the generated models.
  virtual Result<std::string> apply_chat_template(const std::vector<ChatMessage>& messages,
                                                  bool add_generation_prompt) const = 0;
};

// The KV cache of a Context, placed in caller memory by share_layout: `chunks[i]` is
// the mapping of chunk i (layout.chunks[i].size_bytes bytes). The cache type and
// v_trans are the ones in `memory`. The caller keeps the memory alive.
struct KvMemory {
  layout::MemoryShape memory;
  layout::ShareLayout layout;
  std::vector<std::span<std::byte>> chunks;
};

// One token's K and V for one layer, in f32, post-RoPE: what a prefill hands a sink.
// rows is [n_tokens][n_embd_k_gqa + n_embd_v_gqa], K first.
struct LayerRows {
  uint32_t il = 0;
  int32_t pos0 = 0;
  uint32_t n_tokens = 0;
  uint32_t n_embd_k_gqa = 0;
  uint32_t n_embd_v_gqa = 0;
  std::span<const float> rows;
};
using RowSink = std::function<Result<void>(const LayerRows&)>;

class Context {
 public:
  virtual ~Context() = default;
  static Result<std::unique_ptr<Context>> create(std::shared_ptr<const Model> model, KvMemory kv, int n_threads);

  // Evaluates `tokens` at positions pos0.. and stores their K/V in cells pos0.. of the
  // cache (cells are positions: one sequence, cell i holds position i). Returns the
  // logits of the last token [n_vocab]. Attends to cells 0..pos0+n-1, so cells below
  // pos0 must hold valid K/V (computed here earlier, restored, or adopted).
  virtual Result<std::vector<float>> decode(std::span<const int32_t> tokens, int32_t pos0) = 0;

  // The provider's path: computes the prompt's K/V rows layer by layer and hands each
  // layer to `sink` (which converts and places them: scatter into a region, or a
  // state-file writer), without needing the cache memory to be the destination.
  virtual Result<void> prefill(std::span<const int32_t> tokens, RowSink sink) = 0;

  virtual const Model& model() const = 0;
  virtual int32_t n_ctx() const = 0;
};

// Greedy: the arg max (lowest id on ties).
int32_t sample_greedy(std::span<const float> logits);
// Softmax at `temperature` then a draw from `rng`: the same seed gives the same ids.
int32_t sample_temperature(std::span<const float> logits, float temperature, std::mt19937_64& rng);

}  // namespace kvshare::refmodel
