// Fuzzes the layout header parser: any bytes give a header or an error, never a crash,
// a hang or an unbounded allocation. A header that parses must re-encode to a document
// that parses to the same bytes again.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "layout/share_header.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto header = kvshare::layout::parse_share_header(text, "fuzz");
  if (!header) return 0;
  const std::string again = kvshare::layout::to_json(*header, false);
  auto reparsed = kvshare::layout::parse_share_header(again, "fuzz re-encode");
  if (!reparsed || kvshare::layout::to_json(*reparsed, false) != again) std::abort();
  (void)kvshare::layout::check_compatible(*header, *reparsed, "fuzz");
  return 0;
}
