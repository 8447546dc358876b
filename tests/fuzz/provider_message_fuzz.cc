// Fuzzes the resident provider protocol (kvshare/share/provider_protocol.h): what a resident
// prefill provider reads from kvshare-serve and serve reads from the provider. Any bytes
// give a message or an error, never a crash or a hang, and a message that parses
// re-encodes to one that parses to the same text (a region request's share and its layout
// header included).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "kvshare/share/provider_protocol.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvshare;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  if (auto request = parse_provider_request(text, "fuzz")) {
    const std::string again = encode_provider_request(*request);
    auto reparsed = parse_provider_request(again, "fuzz re-encode");
    if (!reparsed || encode_provider_request(*reparsed) != again) std::abort();
  }
  if (auto reply = parse_provider_reply(text, "fuzz")) {
    const std::string again = encode_provider_reply(*reply);
    auto reparsed = parse_provider_reply(again, "fuzz re-encode");
    if (!reparsed || encode_provider_reply(*reparsed) != again) std::abort();
  }
  return 0;
}
