#include "route/sse_events.h"

#include <cerrno>

namespace kvshare::route {

Result<std::vector<std::string>> parse_sse_events(std::string_view body) {
  std::vector<std::string> events;
  size_t offset = 0;
  while (offset < body.size()) {
    const size_t end = body.find("\n\n", offset);
    if (end == std::string_view::npos) {
      return fail(EINVAL, "SSE body: event at byte {} is not terminated by a blank line", offset);
    }
    const std::string_view event = body.substr(offset, end - offset);
    if (!event.empty() && event.front() == ':') {
      offset = end + 2;  // a ping comment
      continue;
    }
    if (event.substr(0, 6) != "data: ") {
      return fail(EINVAL, "SSE body: event at byte {} does not start with \"data: \"", offset);
    }
    if (event.find('\n') != std::string_view::npos) {
      return fail(EINVAL, "SSE body: event at byte {} spans several lines", offset);
    }
    events.emplace_back(event.substr(6));
    offset = end + 2;
  }
  return events;
}

}  // namespace kvshare::route
