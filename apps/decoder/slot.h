// The decoder's one slot: the tokens its cells hold, the prompt-cache rule that decides how
// much of a new prompt must be evaluated, the generation loop, and the slot actions
// (save, restore, erase, share, adopt). Mirrors server_slot and update_slots in
// llama-server's server-context.cpp for a single sequence of a plain KV cache.
//
// Thread safety: every public call may come from any HTTP thread. Work on the cache is
// serialized (a second request waits, as llama-server defers a task for a busy slot);
// to_json() never waits for a running request.
#pragma once

#include <nlohmann/json.hpp>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "apps/decoder/api_error.h"
#include "apps/decoder/completion.h"
#include "apps/decoder/slot_engine.h"

namespace kvshare::decoder {

// Called for each streamed token; returns false when the client has gone, which ends
// the generation (the slot keeps what it evaluated).
using TokenCallback = std::function<bool(const PartialToken&)>;

struct SlotFileReply {
  std::string filename;
  int32_t n_tokens = 0;
  uint64_t n_bytes = 0;
  double ms = 0.0;
};

class Slot {
 public:
  Slot(SlotEngine& engine, int32_t id);

  int32_t id() const { return id_; }
  int32_t n_ctx() const;

  // The checks llama-server makes before it starts a task (launch_slot_with_task and the
  // start of prompt processing): ids inside the vocabulary, the prompt shorter than the
  // context. They answer before any stream starts.
  ApiResult<void> validate_prompt(std::span<const int32_t> prompt) const;

  // Runs one completion: reuses the longest cached prefix (cache_prompt), evaluates the
  // rest (at least one token), then samples until a stop condition. Streamed tokens go to
  // `on_token` when params.stream. `cancel` (may be null) ends the generation early.
  ApiResult<CompletionResult> complete(std::span<const int32_t> prompt, const CompletionParams& params,
                                       const TokenCallback& on_token, const std::atomic<bool>* cancel);

  ApiResult<SlotFileReply> save(const std::string& filename, const std::filesystem::path& path);
  ApiResult<SlotFileReply> restore(const std::string& filename, const std::filesystem::path& path);
  // Returns the number of tokens the slot held.
  int32_t erase();

  struct ShareResult {
    ShareReply reply;
    int32_t n_cached = 0;  // leading `tokens` the slot's cells already hold (0 without tokens)
    double ms = 0.0;
  };
  // Sends the region to the broker at `socket_path`. With `tokens` (the ids the caller
  // will hand over, checked against the vocabulary before anything is sent) the reply
  // says how many of them cells 0.. already hold as positions 0..: the longest common
  // prefix of `tokens` and the slot's cached tokens. The share leaves the slot's cells
  // and cached tokens as they are, so the provider need write only the cells after them.
  ApiResult<ShareResult> share(const std::string& socket_path, const std::vector<int32_t>* tokens = nullptr);
  struct AdoptResult {
    int32_t n_adopted = 0;
    double ms = 0.0;
  };
  // Takes cells 0..tokens.size()-1 as the provider of `share_id` left them. `n_cached`:
  // the first n_cached of them were the slot's own cells through the share (what share
  // answered); refused, slot unchanged, when the slot no longer holds those tokens.
  ApiResult<AdoptResult> adopt(std::span<const int32_t> tokens, uint64_t share_id, uint32_t n_cached = 0);

  // One element of GET /slots (server_slot::to_json with only_metrics).
  Json to_json() const;
  bool is_processing() const;
  // The tokens the slot's cells hold now (a copy).
  std::vector<int32_t> cached_tokens() const;

 private:
  struct TaskStatus;  // what GET /slots shows about the last task

  SlotEngine& engine_;
  const int32_t id_;

  std::mutex work_;              // held for the whole of any operation on the cells
  std::vector<int32_t> tokens_;  // guarded by work_ (and status_ for readers)

  mutable std::mutex status_;
  bool is_processing_ = false;
  std::optional<int32_t> id_task_;  // set once a completion ran
  int32_t next_task_id_ = 0;
  int32_t n_prompt_tokens_processed_ = 0;
  int32_t n_prompt_tokens_cache_ = 0;
  CompletionParams last_params_;
  bool has_next_token_ = false;
  bool has_new_line_ = false;
  int32_t n_remaining_ = -1;
  int32_t n_decoded_ = 0;

  void set_tokens(std::vector<int32_t> tokens);
};

// The byte length of `text` without an incomplete UTF-8 sequence at its end
// (server-common.cpp validate_utf8): text is only sent once its characters are whole.
size_t complete_utf8_prefix(std::string_view text);

// The position in `text` where a suffix of `text` starts that is a prefix of `stop`
// (common.cpp string_find_partial_stop), npos if none: text that might become a stop word.
size_t find_partial_stop(std::string_view text, std::string_view stop);

}  // namespace kvshare::decoder
