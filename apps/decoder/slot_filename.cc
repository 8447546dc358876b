#include "apps/decoder/slot_filename.h"

#include <cstdint>

namespace kvshare::decoder {
namespace {

struct Codepoint {
  bool ok = false;
  uint32_t value = 0;
  size_t length = 0;
};

// Mirrors common_parse_utf8_codepoint (common/unicode.cpp): lead byte decides the length,
// every continuation byte must be 10xxxxxx; overlong forms are rejected by the caller.
Codepoint parse_codepoint(std::string_view text, size_t offset) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(text[offset + i]); };
  const uint8_t lead = byte(0);
  size_t length = 0;
  uint32_t value = 0;
  if (lead < 0x80) return {true, lead, 1};
  if ((lead & 0xE0) == 0xC0) {
    length = 2;
    value = lead & 0x1F;
  } else if ((lead & 0xF0) == 0xE0) {
    length = 3;
    value = lead & 0x0F;
  } else if ((lead & 0xF8) == 0xF0) {
    length = 4;
    value = lead & 0x07;
  } else {
    return {};  // a continuation byte or 0xF8.. as a lead byte
  }
  if (offset + length > text.size()) return {};
  for (size_t i = 1; i < length; ++i) {
    if ((byte(i) & 0xC0) != 0x80) return {};
    value = (value << 6) | (byte(i) & 0x3F);
  }
  return {true, value, length};
}

bool is_forbidden(uint32_t c) {
  return c <= 0x1F || c == 0x7F || (c >= 0x80 && c <= 0x9F) || c == 0xFF0E || c == 0x2215 || c == 0x2216 ||
         (c >= 0xD800 && c <= 0xDFFF) || c > 0x10FFFF || c == 0xFFFD || c == 0xFEFF || c == ':' || c == '*' ||
         c == '?' || c == '"' || c == '<' || c == '>' || c == '|' || c == '/' || c == '\\';
}

}  // namespace

bool is_valid_slot_filename(std::string_view name) {
  if (name.empty() || name.size() > 255) return false;
  for (size_t offset = 0; offset < name.size();) {
    const Codepoint cp = parse_codepoint(name, offset);
    if (!cp.ok) return false;
    const bool is_overlong = (cp.length == 2 && cp.value < 0x80) || (cp.length == 3 && cp.value < 0x800) ||
                             (cp.length == 4 && cp.value < 0x10000);
    if (is_overlong || is_forbidden(cp.value)) return false;
    offset += cp.length;
  }
  // Windows strips these, so the file would get another name than the one asked for.
  if (name.front() == ' ' || name.back() == ' ' || name.back() == '.') return false;
  if (name.find("..") != std::string_view::npos) return false;
  return name != ".";
}

}  // namespace kvshare::decoder
