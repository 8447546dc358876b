// Request bodies to token ids, as llama-server turns them (server-common.cpp
// tokenize_mixed / tokenize_input_prompts, oaicompat_chat_params_parse).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "apps/decoder/api_error.h"
#include "apps/decoder/slot_engine.h"

namespace kvshare::decoder {

// "content" of /tokenize or one prompt of a completion: a string, an array of ids, or an
// array mixing strings and ids (only the first element, if a string, gets add_special).
ApiResult<std::vector<int32_t>> tokenize_mixed(const SlotEngine& engine, const Json& content, bool add_special,
                                               bool parse_special);

// The "prompt" of a completion request: a string, ids, mixed, or {"prompt_string": ...}.
// Several prompts (an array of strings or arrays) are refused: this decoder has one slot
// and answers one prompt per request. Errors are 400s with llama-server's messages.
ApiResult<std::vector<int32_t>> tokenize_completion_prompt(const SlotEngine& engine, const Json& prompt);

// oaicompat_chat_params_parse without tools, grammars or media: checks "messages", renders
// them with the model's template (add_generation_prompt, default true) and returns the
// native request: every field of `body` plus "prompt" (the rendered text, a leading BOS
// text removed when the vocabulary adds BOS itself) and "stop" as an array.
ApiResult<Json> chat_to_completion_request(const SlotEngine& engine, const Json& body);

// The text of `ids`, special tokens included (/detokenize, tokens_to_str). An id outside
// the vocabulary is a 500, as llama-server's range-checked lookup throws.
ApiResult<std::string> detokenize(const SlotEngine& engine, const std::vector<int32_t>& ids);

}  // namespace kvshare::decoder
