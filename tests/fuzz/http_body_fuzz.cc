// Fuzzes the HTTP bodies that reach the KV: kvshare-decoder's slot actions (share, adopt,
// save/restore's filename) and kvshare-serve's side of the same exchange (the prompt it
// reads from a client's request, the request body it forwards after a handoff, the
// decoder's error replies, the prompt_n scan of its answers and the SSE framing check
// clients and tests read streamed replies with). Any bytes give a request
// or an error, never a crash or an exception.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <nlohmann/json.hpp>

#include "apps/decoder/slot_request.h"
#include "route/api_key.h"
#include "route/decoder_client.h"
#include "route/handoff.h"
#include "route/reply_timings_scanner.h"
#include "route/sse_events.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  (void)kvshare::decoder::parse_share_request(body);
  (void)kvshare::decoder::parse_adopt_request(body);
  (void)kvshare::decoder::parse_slot_file_request(body);

  // serve: a client's body is forwarded as a JSON object with the slot fields set.
  const nlohmann::json request = nlohmann::json::parse(body, nullptr, false);
  for (const auto endpoint : {kvshare::route::Endpoint::chat_completions, kvshare::route::Endpoint::completions})
    (void)kvshare::route::request_prompt(endpoint, request);
  if (request.is_object()) (void)kvshare::route::forward_body(request);
  (void)kvshare::route::error_message_of(std::string(body));
  for (const bool is_event_stream : {false, true}) {
    kvshare::route::ReplyTimingsScanner scanner(is_event_stream);
    scanner.feed(body.substr(0, size / 2));
    scanner.feed(body.substr(size / 2));
    (void)scanner.finish();
  }
  (void)kvshare::route::parse_sse_events(body);
  // The key check sees header values a client chose.
  (void)kvshare::route::api_key_accepted({"key"}, body, {});
  (void)kvshare::route::parse_api_key_list(body);
  return 0;
}
