// Finds `timings.prompt_n` in a decoder reply as it is relayed, without holding it up: an
// SSE stream is scanned line by line (`data: {...}`; the final chunk carries timings), a
// plain JSON reply is kept (up to a cap) and parsed at the end. Bytes are only read,
// never changed: the client gets exactly what the decoder sent.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace kvshare::route {

class PromptNScanner {
 public:
  explicit PromptNScanner(bool is_event_stream) : is_event_stream_(is_event_stream) {}
  void feed(std::string_view bytes);
  // The last prompt_n seen (SSE) or the body's (JSON); nullopt when the reply has none.
  std::optional<int64_t> finish();

 private:
  void scan_line(std::string_view line);
  static constexpr size_t kMaxHeldBytes = 8 << 20;  // a longer JSON reply is not scanned
  bool is_event_stream_;
  bool overflowed_ = false;
  std::string held_;  // SSE: the unfinished line; JSON: the body so far
  std::optional<int64_t> prompt_n_;
};

}  // namespace kvshare::route
