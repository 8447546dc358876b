// A completion request's parameters and result, named as llama-server names them
// (server-schema.cpp make_llama_cmpl_schema, server-task.h result_timings and
// server_task_result_cmpl_final), so the JSON built from them reads side by side.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "apps/decoder/api_error.h"

namespace kvshare::decoder {

// llama-server's default sampler seed: LLAMA_DEFAULT_SEED, meaning "pick a random one".
inline constexpr uint32_t kDefaultSeed = 0xFFFFFFFF;

enum class ResponseFormat {
  native,          // /completion, /completions
  oai_completion,  // /v1/completions
  oai_chat,        // /v1/chat/completions
};

enum class StopType { none, eos, limit, word };
std::string_view stop_type_name(StopType stop);

struct CompletionParams {
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  bool cache_prompt = true;
  bool return_tokens = false;
  bool timings_per_token = false;
  bool ignore_eos = false;
  int32_t n_predict = -1;  // aliases max_completion_tokens, max_tokens
  int32_t n_keep = 0;
  float temperature = 0.8f;  // llama-server's default; <= 0 is greedy
  uint32_t seed = kDefaultSeed;
  std::vector<std::string> stop;  // "stop": a string or an array of strings
  int32_t id_slot = -1;

  // The subset of task_params::to_json this decoder honours, with llama-server's keys
  // (generation_settings in replies, params in GET /slots).
  Json to_json() const;
};

// Reads the fields llama-server reads (through layout::JsonReader), with its rules: null
// means "absent", a wrongly typed value is 400 naming the field and the value
// ("completion request: \"n_predict\" is \"many\", not a number"), a hard limit is 400
// "Field 'n_keep': Value must be between ...", temperature is clamped to >= 0. Unknown
// fields are ignored.
ApiResult<CompletionParams> parse_completion_params(const Json& body);

struct Timings {
  int32_t cache_n = -1;
  int32_t prompt_n = -1;
  double prompt_ms = 0.0;
  double prompt_per_token_ms = 0.0;
  double prompt_per_second = 0.0;
  int32_t predicted_n = -1;
  double predicted_ms = 0.0;
  double predicted_per_token_ms = 0.0;
  double predicted_per_second = 0.0;

  Json to_json() const;
};

// One sampled token as a stream chunk carries it.
struct PartialToken {
  int32_t id = -1;
  std::string text;  // text_to_send: "" while a stop word may be forming
  int32_t n_decoded = 0;
  int32_t n_prompt_tokens = 0;
  int32_t n_prompt_tokens_cache = 0;
  std::optional<Timings> timings;  // on a stop-word stop, or with timings_per_token
};

struct CompletionResult {
  int32_t id_slot = 0;
  std::string content;          // "" in stream mode: the chunks carried it
  std::vector<int32_t> tokens;  // generated ids with return_tokens (and not streaming)
  std::string prompt;           // the prompt detokenized with special tokens
  int32_t n_decoded = 0;        // tokens_predicted
  int32_t n_prompt_tokens = 0;  // tokens_evaluated
  int32_t n_prompt_tokens_cache = 0;
  int32_t n_tokens_cached = 0;  // tokens the slot holds afterwards
  bool truncated = false;
  bool has_new_line = false;
  StopType stop = StopType::none;
  std::string stopping_word;
  Timings timings;
};

}  // namespace kvshare::decoder
