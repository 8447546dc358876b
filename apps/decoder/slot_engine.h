// What the decoder's HTTP layer needs from a model and its KV cache, as a small interface:
// the server, slot and prompt-cache logic are written against it and unit-tested with a
// fake, and refmodel_engine.h adapts the real transformer, state files and share/adopt.
// The cache is one sequence whose cell i holds position i (llama.cpp's single-slot
// layout), so "the slot's cached tokens" and "cells 0..n-1" are the same thing.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "layout/error.h"
#include "refmodel/engine.h"

namespace kvshare::decoder {

// What /props and /v1/models report about the model.
struct ModelInfo {
  std::string model_path;     // as given to -m (llama-server uses it as the model name)
  std::string chat_template;  // the template source, "" when the model has none
  std::string bos_token;      // text of BOS, "" when none
  std::string eos_token;      // text of EOS, "" when none
  std::string vocab_type = "bpe";
  int32_t n_vocab = 0;
  int32_t n_ctx_train = 0;
  int32_t n_embd = 0;
  uint64_t n_params = 0;
  uint64_t size_bytes = 0;
};

struct RestoredState {
  std::vector<int32_t> tokens;  // the file's token section; cells 0..tokens.size()-1 now hold them
  uint64_t n_bytes_read = 0;
};

// Whether POST /slots/N?action=share can work in this process, and why not.
enum class ShareAvailability {
  enabled,        // ONEBIT_KV_SHARE set and the KV lives in an exported region
  flag_not_set,   // ONEBIT_KV_SHARE unset: the KV is private
  cannot_export,  // the flag is set but the KV backend cannot export its memory
};

struct ShareReply {
  uint64_t share_id = 0;
  std::string backend;        // export backend of the region ("memfd", "udmabuf", "dmaheap")
  uint32_t n_fds = 0;         // fds sent with the message
  uint64_t region_bytes = 0;  // sum of the chunk sizes
};

// Why an adopt was refused: the HTTP layer maps these to 400 with the message.
enum class AdoptRefusal { stale_share_id, too_many_tokens, bad_token, other };
struct AdoptError {
  AdoptRefusal kind = AdoptRefusal::other;
  Error error;
};

class SlotEngine {
 public:
  virtual ~SlotEngine() = default;

  virtual const ModelInfo& info() const = 0;
  // Cells of the one sequence (llama-server's n_ctx per slot).
  virtual int32_t n_ctx() const = 0;
  virtual int32_t n_vocab() const = 0;

  // llama_tokenize semantics: add_special adds BOS when the vocabulary does; parse_special
  // turns special-token texts into their ids. Fails when the vocabulary cannot match
  // llama.cpp's text tokenization (the error says to send token ids instead).
  virtual Result<std::vector<int32_t>> tokenize(std::string_view text, bool add_special, bool parse_special) const = 0;
  // common_token_to_piece: with `special` false a control token (BOS, EOS, EOT,
  // <|im_end|>...) renders as "", as llama-server's generated text does.
  virtual std::string token_to_piece(int32_t id, bool special) const = 0;
  virtual bool is_end_of_generation(int32_t id) const = 0;
  // The rendered chat prompt; a leading BOS text is the caller's to strip.
  virtual Result<std::string> apply_chat_template(const std::vector<refmodel::ChatMessage>& messages,
                                                  bool add_generation_prompt) const = 0;

  // Evaluates `tokens` at positions pos0.. into cells pos0.., attending to cells 0..pos0-1
  // as they are. Returns the last token's logits [n_vocab]. Blocking; callers serialize.
  virtual Result<std::vector<float>> eval(std::span<const int32_t> tokens, int32_t pos0) = 0;

  // llama_state_seq_save_file of cells 0..tokens.size()-1 with `tokens` as the token
  // section. Returns the file size in bytes.
  virtual Result<uint64_t> save_state(const std::filesystem::path& path, std::span<const int32_t> tokens) = 0;
  // llama_state_seq_load_file into cells 0..: refuses a file of another shape, type or
  // v_trans, or with more than `max_tokens` tokens. On failure the cells' contents are
  // unspecified (the caller forgets its cached tokens).
  virtual Result<RestoredState> restore_state(const std::filesystem::path& path, uint32_t max_tokens) = 0;

  virtual ShareAvailability share_availability() const = 0;
  // Why share is refused when share_availability() is not `enabled`: names both causes
  // (flag not set; the KV backend cannot export), as kvshare::share_unavailable_reason.
  virtual std::string share_refusal() const;
  // Connects to the AF_UNIX socket at `socket_path`, sends the layout header and the
  // region's fds, and returns the new share_id (every share makes the earlier one stale).
  virtual Result<ShareReply> share(const std::string& socket_path) = 0;
  // Takes cells 0..tokens.size()-1 as positions 0.. with no data movement: the provider
  // of share `share_id` wrote them. Refuses a share_id that is not the latest, or more
  // tokens than cells.
  virtual tl::expected<void, AdoptError> adopt(std::span<const int32_t> tokens, uint64_t share_id) = 0;
};

}  // namespace kvshare::decoder
