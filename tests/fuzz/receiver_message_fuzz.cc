// Fuzzes the remote receiver's control channel (layout/receiver_message.h): what
// kvshare-remote-receiver reads from serve and serve reads from the receiver. Any bytes give
// a message or an error, never a crash or a hang, and a message that parses re-encodes to
// one that parses to the same text.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "layout/receiver_message.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvshare::layout;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  if (auto request = parse_receiver_request(text, "fuzz")) {
    const std::string again = encode_receiver_request(*request);
    auto reparsed = parse_receiver_request(again, "fuzz re-encode");
    if (!reparsed || encode_receiver_request(*reparsed) != again) std::abort();
  }
  if (auto reply = parse_receiver_reply(text, "fuzz")) {
    const std::string again = encode_receiver_reply(*reply);
    auto reparsed = parse_receiver_reply(again, "fuzz re-encode");
    if (!reparsed || encode_receiver_reply(*reparsed) != again) std::abort();
  }
  return 0;
}
