#include "apps/decoder/slot.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>

namespace kvshare::decoder {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// Prompt tokens evaluated per eval() call: llama-server's default physical batch (-ub).
constexpr size_t kPromptChunk = 512;

size_t common_prefix(std::span<const int32_t> a, std::span<const int32_t> b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

Timings make_timings(int32_t cache_n, int32_t prompt_n, double prompt_ms, int32_t predicted_n, double predicted_ms) {
  // Same arithmetic as server_slot::get_timings, including its division by zero for an
  // empty prompt (the JSON then carries null, as llama-server's does).
  Timings t;
  t.cache_n = cache_n;
  t.prompt_n = prompt_n;
  t.prompt_ms = prompt_ms;
  t.prompt_per_token_ms = prompt_ms / prompt_n;
  t.prompt_per_second = 1e3 / prompt_ms * prompt_n;
  t.predicted_n = predicted_n;
  t.predicted_ms = predicted_ms;
  t.predicted_per_token_ms = predicted_ms / predicted_n;
  t.predicted_per_second = 1e3 / predicted_ms * predicted_n;
  return t;
}

// server_slot::find_stopping_strings: with `is_full_stop`, a stop word that now appears
// whole (searched only near the end); otherwise the start of a partial one.
size_t find_stopping_strings(const std::vector<std::string>& stops, std::string_view text, size_t last_token_size,
                             bool is_full_stop, std::string* stopping_word) {
  size_t stop_pos = std::string::npos;
  for (const std::string& word : stops) {
    size_t pos;
    if (is_full_stop) {
      const size_t tmp = word.size() + last_token_size;
      const size_t from_pos = text.size() > tmp ? text.size() - tmp : 0;
      pos = text.find(word, from_pos);
    } else {
      pos = find_partial_stop(text, word);
    }
    if (pos != std::string::npos && (stop_pos == std::string::npos || pos < stop_pos)) {
      if (is_full_stop) *stopping_word = word;
      stop_pos = pos;
    }
  }
  return stop_pos;
}

}  // namespace

size_t complete_utf8_prefix(std::string_view text) {
  const size_t len = text.size();
  for (size_t i = 1; i <= 4 && i <= len; ++i) {
    const auto c = static_cast<unsigned char>(text[len - i]);
    if ((c & 0xE0) == 0xC0) {
      if (i < 2) return len - i;
    } else if ((c & 0xF0) == 0xE0) {
      if (i < 3) return len - i;
    } else if ((c & 0xF8) == 0xF0) {
      if (i < 4) return len - i;
    }
  }
  return len;
}

size_t find_partial_stop(std::string_view text, std::string_view stop) {
  if (text.empty() || stop.empty()) return std::string::npos;
  for (size_t n = std::min(stop.size(), text.size()); n > 0; --n) {
    if (text.substr(text.size() - n) == stop.substr(0, n)) return text.size() - n;
  }
  return std::string::npos;
}

Slot::Slot(SlotEngine& engine, int32_t id) : engine_(engine), id_(id) {}

int32_t Slot::n_ctx() const { return engine_.n_ctx(); }

void Slot::set_tokens(std::vector<int32_t> tokens) {
  std::lock_guard status(status_);
  tokens_ = std::move(tokens);
}

std::vector<int32_t> Slot::cached_tokens() const {
  std::lock_guard status(status_);
  return tokens_;
}

bool Slot::is_processing() const {
  std::lock_guard status(status_);
  return is_processing_;
}

ApiResult<void> Slot::validate_prompt(std::span<const int32_t> prompt) const {
  const int32_t n_vocab = engine_.n_vocab();
  for (int32_t id : prompt) {
    if (id < 0 || id >= n_vocab) return api_fail(ErrorType::invalid_request, "Prompt contains invalid tokens");
  }
  const auto n_tokens = static_cast<int32_t>(prompt.size());
  if (n_tokens >= n_ctx()) {
    ApiError error{ErrorType::exceed_context_size,
                   fmt::format("request ({} tokens) exceeds the available context size ({} tokens), try increasing it",
                               n_tokens, n_ctx())};
    error.n_prompt_tokens = n_tokens;
    error.n_ctx = n_ctx();
    return tl::unexpected(error);
  }
  return {};
}

ApiResult<CompletionResult> Slot::complete(std::span<const int32_t> prompt, const CompletionParams& params,
                                           const TokenCallback& on_token, const std::atomic<bool>* cancel) {
  if (auto valid = validate_prompt(prompt); !valid) return tl::unexpected(valid.error());
  std::lock_guard work(work_);
  {
    std::lock_guard status(status_);
    is_processing_ = true;
    id_task_ = next_task_id_++;
    last_params_ = params;
    n_decoded_ = 0;
    n_remaining_ = -1;
    has_next_token_ = true;
    has_new_line_ = false;
  }
  struct Release {
    Slot& slot;
    ~Release() {
      std::lock_guard status(slot.status_);
      slot.is_processing_ = false;
    }
  } release{*this};

  const auto t_start = Clock::now();
  const auto n_prompt = static_cast<int32_t>(prompt.size());
  CompletionResult result;
  result.id_slot = id_;
  result.n_prompt_tokens = n_prompt;
  {
    std::string text;
    for (int32_t id : prompt) text += engine_.token_to_piece(id, true);
    result.prompt = std::move(text);
  }

  if (prompt.empty()) {
    // llama-server: "empty prompt - releasing slot" with an empty final response.
    result.n_tokens_cached = static_cast<int32_t>(tokens_.size());
    result.timings = make_timings(0, 0, 0.0, 0, 0.0);
    return result;
  }

  // The prompt-cache rule (update_slots, SLOT_STATE_STARTED) for one sequence of a plain
  // KV cache: n_swa is 0 and the sequence's smallest position is 0, and there are no
  // checkpoints, so a prefix is reusable unless the threshold is 0 with cells to reuse.
  int32_t n_past = params.cache_prompt ? static_cast<int32_t>(common_prefix(tokens_, prompt)) : 0;
  {
    const int32_t pos_next = n_past;
    const bool has_new_tokens = n_past < n_prompt;
    const int32_t pos_min_thold = std::max(0, pos_next - (has_new_tokens ? 0 : 1));
    const int32_t pos_min = 0;
    if (n_past > 0 && n_past <= static_cast<int32_t>(tokens_.size()) && pos_min >= pos_min_thold) {
      n_past = 0;  // no checkpoint can help: full re-processing, as llama-server does
    }
  }
  // [TAG_PROMPT_LOGITS]: at least one token is evaluated, to get logits.
  if (n_past == n_prompt && n_past > 0) --n_past;

  {
    std::vector<int32_t> kept(tokens_.begin(), tokens_.begin() + n_past);
    set_tokens(std::move(kept));
  }
  {
    std::lock_guard status(status_);
    n_prompt_tokens_cache_ = n_past;
    n_prompt_tokens_processed_ = 0;
  }

  std::vector<float> logits;
  for (int32_t pos = n_past; pos < n_prompt;) {
    const int32_t n = std::min<int32_t>(static_cast<int32_t>(kPromptChunk), n_prompt - pos);
    auto evaluated = engine_.eval(prompt.subspan(pos, n), pos);
    if (!evaluated) {
      std::fprintf(stderr, "kvshare-decoder: slot %d: prompt evaluation at position %d failed: %s\n", id_, pos,
                   evaluated.error().what().c_str());
      return api_fail(ErrorType::server, "prompt evaluation failed: " + evaluated.error().what());
    }
    logits = std::move(*evaluated);
    {
      std::lock_guard status(status_);
      tokens_.insert(tokens_.end(), prompt.begin() + pos, prompt.begin() + pos + n);
      n_prompt_tokens_processed_ += n;
    }
    pos += n;
  }
  const int32_t n_processed = n_prompt - n_past;

  std::mt19937_64 rng(params.seed == kDefaultSeed ? std::random_device{}() : params.seed);
  std::string generated_text;
  size_t n_sent_text = 0;
  int32_t n_decoded = 0;
  double prompt_ms = 0.0;
  double predicted_ms = 0.0;
  Clock::time_point t_start_generation;
  bool has_next_token = true;
  bool has_new_line = false;
  int32_t n_remaining = -1;

  while (true) {
    if (params.ignore_eos) {
      for (int32_t id = 0; id < static_cast<int32_t>(logits.size()); ++id) {
        if (engine_.is_end_of_generation(id)) logits[id] = -std::numeric_limits<float>::infinity();
      }
    }
    const int32_t id = params.temperature > 0.0f ? refmodel::sample_temperature(logits, params.temperature, rng)
                                                 : refmodel::sample_greedy(logits);
    ++n_decoded;
    const auto t_now = Clock::now();
    if (n_decoded == 1) {
      t_start_generation = t_now;
      prompt_ms = std::chrono::duration<double, std::milli>(t_now - t_start).count();
    }
    predicted_ms = std::max(0.001, std::chrono::duration<double, std::milli>(t_now - t_start_generation).count());

    // process_token
    const std::string token_str = engine_.token_to_piece(id, false);
    generated_text += token_str;
    if (params.return_tokens && !params.stream) result.tokens.push_back(id);
    has_next_token = true;
    const bool is_eog = engine_.is_end_of_generation(id);
    const bool incomplete = complete_utf8_prefix(generated_text) < generated_text.size();
    std::string text_to_send;
    if (!incomplete) {
      size_t pos = std::min(n_sent_text, generated_text.size());
      const std::string str_test = generated_text.substr(pos);
      bool send_text = true;
      size_t stop_pos = find_stopping_strings(params.stop, str_test, token_str.size(), true, &result.stopping_word);
      if (stop_pos != std::string::npos) {
        result.stop = StopType::word;
        has_next_token = false;
        generated_text.erase(pos + stop_pos);
        pos = std::min(n_sent_text, generated_text.size());
      } else if (has_next_token && !is_eog) {
        std::string unused;
        stop_pos = find_stopping_strings(params.stop, str_test, token_str.size(), false, &unused);
        send_text = stop_pos == std::string::npos;
      }
      if (send_text) {
        text_to_send = generated_text.substr(pos);
        n_sent_text += text_to_send.size();
      }
      if (params.stream) {
        PartialToken partial{id, text_to_send, n_decoded, n_prompt, n_past, std::nullopt};
        if (result.stop != StopType::none || params.timings_per_token) {
          partial.timings = make_timings(n_past, n_processed, prompt_ms, n_decoded, predicted_ms);
        }
        if (!on_token(partial)) has_next_token = false;  // the client has gone
      }
    }
    if (incomplete) has_next_token = true;

    // Context shift is off by default in llama-server: stop one cell short of the end.
    if (static_cast<int32_t>(tokens_.size()) + 1 >= n_ctx()) {
      result.truncated = true;
      result.stop = StopType::limit;
      has_next_token = false;
    }
    if (n_decoded > 0 && has_next_token && params.n_predict != -1) {
      n_remaining = params.n_predict - n_decoded;
      if (n_remaining <= 0) {
        result.stop = StopType::limit;
        has_next_token = false;
      }
    }
    if (text_to_send.find('\n') != std::string::npos) has_new_line = true;
    if (is_eog) {
      result.stop = StopType::eos;
      has_next_token = false;
    }
    if (cancel != nullptr && cancel->load()) has_next_token = false;
    {
      std::lock_guard status(status_);
      n_decoded_ = n_decoded;
      n_remaining_ = n_remaining;
      has_next_token_ = has_next_token;
      has_new_line_ = has_new_line;
    }
    if (!has_next_token) break;

    // The sampled token joins the cache (handle_last_sampled_token) and is evaluated.
    const auto pos = static_cast<int32_t>(tokens_.size());
    auto evaluated = engine_.eval(std::span<const int32_t>(&id, 1), pos);
    if (!evaluated) {
      std::fprintf(stderr, "kvshare-decoder: slot %d: decoding at position %d failed: %s\n", id_, pos,
                   evaluated.error().what().c_str());
      return api_fail(ErrorType::server, "decoding failed: " + evaluated.error().what());
    }
    logits = std::move(*evaluated);
    {
      std::lock_guard status(status_);
      tokens_.push_back(id);
    }
  }

  result.content = params.stream ? std::string() : generated_text;
  result.n_decoded = n_decoded;
  result.n_prompt_tokens_cache = n_past;
  result.n_tokens_cached = static_cast<int32_t>(tokens_.size());
  result.has_new_line = has_new_line;
  result.timings = make_timings(n_past, n_processed, prompt_ms, n_decoded, predicted_ms);
  return result;
}

ApiResult<SlotFileReply> Slot::save(const std::string& filename, const std::filesystem::path& path) {
  std::lock_guard work(work_);
  const auto t_start = Clock::now();
  auto written = engine_.save_state(path, tokens_);
  if (!written) {
    std::fprintf(stderr, "kvshare-decoder: slot %d: save to %s failed: %s\n", id_, path.c_str(),
                 written.error().what().c_str());
    return api_fail(ErrorType::server, "Unable to save slot: " + written.error().what());
  }
  return SlotFileReply{filename, static_cast<int32_t>(tokens_.size()), *written, ms_since(t_start)};
}

ApiResult<SlotFileReply> Slot::restore(const std::string& filename, const std::filesystem::path& path) {
  std::lock_guard work(work_);
  const auto t_start = Clock::now();
  auto restored = engine_.restore_state(path, static_cast<uint32_t>(n_ctx()));
  if (!restored) {
    // llama-server clears the slot's token list: its cells may already be overwritten.
    set_tokens({});
    std::fprintf(stderr, "kvshare-decoder: slot %d: restore from %s failed: %s\n", id_, path.c_str(),
                 restored.error().what().c_str());
    return api_fail(ErrorType::invalid_request,
                    "Unable to restore slot, no available space in KV cache or invalid slot save file");
  }
  const auto n_tokens = static_cast<int32_t>(restored->tokens.size());
  set_tokens(std::move(restored->tokens));
  return SlotFileReply{filename, n_tokens, restored->n_bytes_read, ms_since(t_start)};
}

int32_t Slot::erase() {
  std::lock_guard work(work_);
  const auto n_erased = static_cast<int32_t>(tokens_.size());
  set_tokens({});
  return n_erased;
}

ApiResult<Slot::ShareResult> Slot::share(const std::string& socket_path, const std::vector<int32_t>* tokens) {
  // Not under work_: a share only sends the region's fds (the broker may keep it waiting
  // for its connect/send timeouts), and touches no cell or token of this slot.
  const auto t_start = Clock::now();
  if (tokens != nullptr) {
    // Refused before any fd leaves: a wrong id list would make n_cached meaningless.
    const int32_t n_vocab = engine_.n_vocab();
    for (size_t i = 0; i < tokens->size(); ++i) {
      if ((*tokens)[i] >= n_vocab)
        return api_fail(
            ErrorType::invalid_request,
            fmt::format("share: tokens[{}] is {}, outside the vocabulary (0..{})", i, (*tokens)[i], n_vocab - 1));
    }
  }
  auto shared = engine_.share(socket_path);
  if (!shared) {
    std::fprintf(stderr, "kvshare-decoder: slot %d: share over %s failed: %s\n", id_, socket_path.c_str(),
                 shared.error().what().c_str());
    // A listener that failed the trust checks is the caller's fault, not the server's.
    const ErrorType type = shared.error().errno_value() == EPERM ? ErrorType::permission : ErrorType::server;
    return api_fail(type, "Unable to share the KV cache: " + shared.error().what());
  }
  int32_t n_cached = 0;
  if (tokens != nullptr) {
    // Cell i holds position i of the one sequence, so a common prefix of P tokens is
    // cells 0..P-1 as positions 0..P-1. Not capped below tokens->size(): when every
    // token is cached the caller has nothing for a provider to do.
    std::lock_guard status(status_);
    n_cached = static_cast<int32_t>(common_prefix(tokens_, *tokens));
  }
  return ShareResult{*shared, n_cached, ms_since(t_start)};
}

ApiResult<Slot::AdoptResult> Slot::adopt(std::span<const int32_t> tokens, uint64_t share_id, uint32_t n_cached) {
  std::lock_guard work(work_);
  const auto t_start = Clock::now();
  const int32_t n_vocab = engine_.n_vocab();
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= n_vocab) {
      return api_fail(ErrorType::invalid_request, fmt::format("adopt: tokens[{}] is {}, outside the vocabulary (0..{})",
                                                              i, tokens[i], n_vocab - 1));
    }
  }
  if (static_cast<int64_t>(tokens.size()) >= n_ctx()) {
    // The same bound a prompt has: a slot must keep a cell free to evaluate a token.
    return api_fail(ErrorType::invalid_request,
                    fmt::format("adopt: {} tokens do not fit the slot's context of {} cells (at most {})",
                                tokens.size(), n_ctx(), n_ctx() - 1));
  }
  if (n_cached > tokens.size()) {
    return api_fail(ErrorType::invalid_request,
                    fmt::format("adopt: n_cached {} is more than the {} tokens given", n_cached, tokens.size()));
  }
  if (n_cached > 0) {
    // The provider wrote only cells n_cached..: the cells before must still be the ones
    // share counted. An erase, restore or completion since then may have changed them;
    // checked before the engine spends the share_id, so the caller can share again.
    const size_t held = common_prefix(tokens_, tokens.first(n_cached));
    if (held < n_cached) {
      return api_fail(ErrorType::invalid_request,
                      fmt::format("adopt: n_cached {}: the slot holds only {} of these tokens (it was erased, restored "
                                  "or reused since the share); share again",
                                  n_cached, held));
    }
  }
  auto adopted = engine_.adopt(tokens, share_id);
  if (!adopted) {
    // Refused before the cells were taken: what the slot held is gone either way only if
    // the engine says so; a refusal leaves the cells alone, so keep the token list.
    std::fprintf(stderr, "kvshare-decoder: slot %d: adopt refused: %s\n", id_, adopted.error().error.what().c_str());
    const ErrorType type = adopted.error().kind == AdoptRefusal::other ? ErrorType::server : ErrorType::invalid_request;
    return api_fail(type, "adopt: " + adopted.error().error.what());
  }
  set_tokens(std::vector<int32_t>(tokens.begin(), tokens.end()));
  return AdoptResult{static_cast<int32_t>(tokens.size()), ms_since(t_start)};
}

Json Slot::to_json() const {
  std::lock_guard status(status_);
  Json slot = {
      {"id", id_},
      {"n_ctx", n_ctx()},
      {"speculative", false},
      {"is_processing", is_processing_},
  };
  if (id_task_) {
    slot["id_task"] = *id_task_;
    slot["n_prompt_tokens"] = static_cast<int32_t>(tokens_.size());
    slot["n_prompt_tokens_processed"] = n_prompt_tokens_processed_;
    slot["n_prompt_tokens_cache"] = n_prompt_tokens_cache_;
    slot["params"] = last_params_.to_json();
    slot["next_token"] = Json::array({{
        {"has_next_token", has_next_token_},
        {"has_new_line", has_new_line_},
        {"n_remain", n_remaining_},
        {"n_decoded", n_decoded_},
    }});
  }
  return slot;
}

}  // namespace kvshare::decoder
