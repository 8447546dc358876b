#include "kvshare/route/prompt_n_scanner.h"

#include <nlohmann/json.hpp>

namespace kvshare::route {
namespace {

std::optional<int64_t> prompt_n_of(std::string_view json_text) {
  const nlohmann::json json = nlohmann::json::parse(json_text, nullptr, false);
  if (!json.is_object()) return std::nullopt;
  auto timings = json.find("timings");
  if (timings == json.end() || !timings->is_object()) return std::nullopt;
  auto prompt_n = timings->find("prompt_n");
  if (prompt_n == timings->end() || !prompt_n->is_number_integer()) return std::nullopt;
  return prompt_n->get<int64_t>();
}

}  // namespace

void PromptNScanner::scan_line(std::string_view line) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  if (line.substr(0, 5) != "data:") return;
  line.remove_prefix(5);
  while (!line.empty() && line.front() == ' ') line.remove_prefix(1);
  // Only a chunk that mentions timings is worth parsing: most chunks are one token.
  if (line.find("\"prompt_n\"") == std::string_view::npos) return;
  if (auto found = prompt_n_of(line)) prompt_n_ = found;
}

void PromptNScanner::feed(std::string_view bytes) {
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

std::optional<int64_t> PromptNScanner::finish() {
  if (overflowed_) return std::nullopt;
  if (!is_event_stream_) return prompt_n_of(held_);
  if (!held_.empty()) {
    scan_line(held_);
    held_.clear();
  }
  return prompt_n_;
}

}  // namespace kvshare::route
