#include <gtest/gtest.h>

#include "apps/decoder/slot_filename.h"

namespace kvshare::decoder {
namespace {

TEST(SlotFilename, AcceptsPlainNamesAndUnicode) {
  EXPECT_TRUE(is_valid_slot_filename("slot0.bin"));
  EXPECT_TRUE(is_valid_slot_filename("a b.bin"));
  EXPECT_TRUE(is_valid_slot_filename("caf\xC3\xA9.bin"));
  EXPECT_TRUE(is_valid_slot_filename(std::string(255, 'a')));
}

TEST(SlotFilename, RefusesPathTraversalAndSeparators) {
  for (const char* name : {"../x", "..", "a..b", "/etc/passwd", "a/b", "a\\b", "."}) {
    EXPECT_FALSE(is_valid_slot_filename(name)) << name;
  }
}

TEST(SlotFilename, RefusesReservedCharactersAndEdgeSpacesAndTrailingDots) {
  for (const char* name : {"a:b", "a*b", "a?b", "a\"b", "a<b", "a>b", "a|b", " a", "a ", "a.", ""}) {
    EXPECT_FALSE(is_valid_slot_filename(name)) << name;
  }
  EXPECT_FALSE(is_valid_slot_filename(std::string(256, 'a')));
}

TEST(SlotFilename, RefusesControlsLookalikesAndBrokenUtf8) {
  for (const char* name : {"a\x01", "a\x7F", "a\xC2\x85",     // C0, DEL, C1
                           "a\xEF\xBC\x8E", "a\xE2\x88\x95",  // U+FF0E, U+2215
                           "a\xE2\x88\x96", "a\xEF\xBF\xBD",  // U+2216, U+FFFD
                           "\xEF\xBB\xBF"
                           "a",
                           "a\xED\xA0\x80",               // BOM, surrogate
                           "a\xC0\xAE", "a\xE0\x80\xAE",  // overlong '.'
                           "a\x80", "a\xC3", "a\xF8\x88\x80\x80\x80"}) {
    EXPECT_FALSE(is_valid_slot_filename(name)) << name;
  }
}

}  // namespace
}  // namespace kvshare::decoder
