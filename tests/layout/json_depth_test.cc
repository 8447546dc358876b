#include "layout/json_depth.h"

#include <gtest/gtest.h>

#include <string>

namespace kvshare::layout {
namespace {

TEST(JsonNestingDepth, CountsBracketsAndBracesOutsideStrings) {
  EXPECT_EQ(json_nesting_depth("1"), 0);
  EXPECT_EQ(json_nesting_depth(R"({"a":[1,{"b":[]}],"c":{}})"), 4);
  EXPECT_EQ(json_nesting_depth(R"({"[[[[":"{{{{"})"), 1);           // inside strings: not nesting
  EXPECT_EQ(json_nesting_depth(R"({"q\"[[":"\\"})"), 1);            // escaped quote, escaped backslash
  EXPECT_EQ(json_nesting_depth(std::string(100000, '[')), 100000);  // what a hostile peer sends
}

}  // namespace
}  // namespace kvshare::layout
