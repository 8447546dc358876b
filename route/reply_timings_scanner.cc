#include "route/reply_timings_scanner.h"

#include <nlohmann/json.hpp>

namespace kvshare::route {
namespace {

// The timings of one JSON document, or nullopt when it has none (not JSON, no object).
std::optional<ReplyTimings> timings_of(std::string_view json_text) {
  const nlohmann::json json = nlohmann::json::parse(json_text, nullptr, false);
  if (!json.is_object()) return std::nullopt;
  auto timings = json.find("timings");
  if (timings == json.end() || !timings->is_object()) return std::nullopt;
  ReplyTimings found;
  if (auto n = timings->find("prompt_n"); n != timings->end() && n->is_number_integer())
    found.prompt_n = n->get<int64_t>();
  if (auto ms = timings->find("prompt_ms"); ms != timings->end() && ms->is_number())
    found.prompt_ms = ms->get<double>();
  if (auto n = timings->find("predicted_n"); n != timings->end() && n->is_number_integer())
    found.predicted_n = n->get<int64_t>();
  if (auto ms = timings->find("predicted_ms"); ms != timings->end() && ms->is_number())
    found.predicted_ms = ms->get<double>();
  return found;
}

}  // namespace

void ReplyTimingsScanner::scan_line(std::string_view line) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  if (line.substr(0, 5) != "data:") return;
  line.remove_prefix(5);
  while (!line.empty() && line.front() == ' ') line.remove_prefix(1);
  // Only a chunk that mentions timings is worth parsing: most chunks are one token.
  if (line.find("\"prompt_n\"") == std::string_view::npos) return;
  if (auto found = timings_of(line)) timings_ = *found;
}

void ReplyTimingsScanner::feed(std::string_view bytes) {
  if (overflowed_) return;
  if (!is_event_stream_) {
    if (held_.size() + bytes.size() > kMaxHeldBytes) {
      overflowed_ = true;
      held_.clear();
      return;
    }
    held_.append(bytes);
    return;
  }
  size_t start = 0;
  while (true) {
    const size_t newline = bytes.find('\n', start);
    if (newline == std::string_view::npos) break;
    if (held_.empty()) {
      scan_line(bytes.substr(start, newline - start));
    } else {
      held_.append(bytes.substr(start, newline - start));
      scan_line(held_);
      held_.clear();
    }
    start = newline + 1;
  }
  if (held_.size() + (bytes.size() - start) > kMaxHeldBytes) {
    held_.clear();  // a line this long is not an SSE chunk we care about; skip to the next
    return;
  }
  held_.append(bytes.substr(start));
}

ReplyTimings ReplyTimingsScanner::finish() {
  if (overflowed_) return {};
  if (!is_event_stream_) return timings_of(held_).value_or(ReplyTimings{});
  if (!held_.empty()) {
    scan_line(held_);
    held_.clear();
  }
  return timings_;
}

}  // namespace kvshare::route
