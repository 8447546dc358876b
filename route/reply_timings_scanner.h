// Finds a decoder reply's `timings` (prompt_n, prompt_ms, predicted_n, predicted_ms) as it is relayed,
// without holding it up: an SSE stream is scanned line by line (`data: {...}`; the final
// chunk carries timings), a plain JSON reply is kept (up to a cap) and parsed at the end.
// Bytes are only read, never changed: the client gets exactly what the decoder sent.
// serve uses prompt_n to warn of a handoff the decoder did not reuse, and prompt_ms /
// prompt_n to learn the decoder's own prompt speed (docs/hybrid.md, "When serve hands off"),
// and predicted_ms / predicted_n its streams' pace (the load rule's log words).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace kvshare::route {

struct ReplyTimings {
  std::optional<int64_t> prompt_n;     // tokens the decoder evaluated for the prompt
  std::optional<double> prompt_ms;     // the time it took
  std::optional<int64_t> predicted_n;  // tokens it generated
  std::optional<double> predicted_ms;  // the time that took
};

class ReplyTimingsScanner {
 public:
  explicit ReplyTimingsScanner(bool is_event_stream) : is_event_stream_(is_event_stream) {}
  void feed(std::string_view bytes);
  // The last timings seen (SSE) or the body's (JSON); fields the reply lacks are nullopt.
  ReplyTimings finish();

 private:
  void scan_line(std::string_view line);
  static constexpr size_t kMaxHeldBytes = 8 << 20;  // a longer JSON reply is not scanned
  bool is_event_stream_;
  bool overflowed_ = false;
  std::string held_;  // SSE: the unfinished line; JSON: the body so far
  ReplyTimings timings_;
};

}  // namespace kvshare::route
