// Fuzzes the handshake frame parser (length prefix, JSON, fd entries) and, when a share
// message parses, the layout header inside it: any bytes give a message or an error,
// never a crash, a hang or an unbounded allocation.
#include <cstddef>
#include <cstdint>
#include <span>

#include "kvshare/handshake/message.h"
#include "layout/share_header.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  auto message = kvshare::handshake::parse_frame(bytes, "fuzz");
  if (message && message->type == kvshare::handshake::MessageType::share) {
    (void)kvshare::layout::parse_share_header_document(message->header, "fuzz");
    (void)kvshare::handshake::encode_frame(*message);
  }
  // The same bytes as bare JSON (the body without a prefix) reach the field checks more often.
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  (void)kvshare::handshake::parse_json(text, "fuzz");
  // And with a known header, so messages ending in it take the envelope-only path.
  (void)kvshare::handshake::parse_json(text, "fuzz", R"({"format":"kvshare-layout"})");
  return 0;
}
