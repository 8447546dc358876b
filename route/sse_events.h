// Splits a whole SSE reply body (llama-server's streamed completions) into its events, so
// a client or a test reads the payloads rather than the framing.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "layout/error.h"

namespace kvshare::route {

// Splits an SSE body into the payloads of its "data: " lines, checking llama-server's
// framing: every event is exactly one "data: <payload>" line followed by a blank line
// (":"-comment pings are skipped). A body that breaks the framing is an EINVAL error
// naming the byte offset of the event.
Result<std::vector<std::string>> parse_sse_events(std::string_view body);

}  // namespace kvshare::route
