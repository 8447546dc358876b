// Completion replies as llama-server shapes them (server-task.cpp: to_json_non_oaicompat,
// to_json_oaicompat, to_json_oaicompat_chat[_stream], the partial variants) and its SSE
// framing (server-common.cpp format_oai_sse: "data: <json>\n\n" per event).
#pragma once

#include <string>

#include "apps/decoder/api_error.h"
#include "apps/decoder/completion.h"

namespace kvshare::decoder {

struct ResponseContext {
  ResponseFormat format = ResponseFormat::native;
  std::string completion_id;  // "chatcmpl-" + 32 random alphanumerics, one per request
  std::string model;          // the model name (-m as given)
  CompletionParams params;
};

// gen_chatcmplid()
std::string make_completion_id();
// What replies carry as system_fingerprint.
std::string build_info();

// The final result: the whole non-stream body; in stream mode the last event(s) (for
// chat an array of chunks: finish_reason, then usage with include_usage, timings last).
Json final_response(const ResponseContext& context, const CompletionResult& result);

// One streamed token. May be an array of events (chat: the role delta precedes the first
// token) or an empty array (a chat token with no text: nothing to send).
Json partial_response(const ResponseContext& context, const PartialToken& token);

// "data: <json>\n\n" for an object, one such event per element for an array.
std::string format_sse(const Json& data);

// The end of an OpenAI stream; the native stream just ends.
inline constexpr const char* kSseDone = "data: [DONE]\n\n";

}  // namespace kvshare::decoder
