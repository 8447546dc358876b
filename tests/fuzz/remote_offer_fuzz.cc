// Fuzzes what a remote provider and a remote decoder read from their peer: the offer JSON
// (parse_offer_text) and the 56-byte active-message headers (version 2, with the share
// secret; shorter inputs too, so the size and version checks see every length). Any bytes
// give a value or an error, never a crash or a hang. A header that decodes must encode
// back to the same bytes; an offer that parses must re-encode to one that parses the
// same, and a write header decoded from the input is bounds-checked against the offer's
// grant without overflow.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string_view>

#include "kvshare/remote/remote_offer.h"
#include "layout/remote_grant.h"
#include "layout/remote_message.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  {
    const auto header = bytes.first(std::min(size, kvshare::layout::kRemoteHeaderBytes));
    auto same = [&](const kvshare::layout::RemoteHeaderBytes& again) {
      return std::equal(again.begin(), again.end(), header.begin(), header.end());
    };
    if (auto write = kvshare::layout::decode_remote_write(header); write && !same(kvshare::layout::encode(*write)))
      std::abort();
    if (auto done = kvshare::layout::decode_remote_done(header); done && !same(kvshare::layout::encode(*done)))
      std::abort();
  }
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto offer = kvshare::remote::parse_offer_text(text, "fuzz");
  if (!offer) return 0;
  const std::string again = kvshare::remote::to_json(*offer).dump();
  auto reparsed = kvshare::remote::parse_offer_text(again, "fuzz re-encode");
  if (!reparsed || kvshare::remote::to_json(*reparsed).dump() != again) std::abort();
  auto grant = kvshare::remote::offer_grant(*offer);
  if (!grant) std::abort();  // parse_offer checked it
  // Writes derived from the input's bytes: whatever they say, the check answers.
  uint64_t words[3] = {0, 0, 0};
  for (size_t i = 0; i < size && i < sizeof words; ++i) reinterpret_cast<uint8_t*>(words)[i] = data[i];
  (void)kvshare::layout::check_write(*grant, static_cast<uint32_t>(words[0]), words[1], words[2]);
  return 0;
}
