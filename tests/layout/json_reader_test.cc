// layout::JsonReader, the one reader of "field X of type T, or say which field is wrong":
// the path of a nested object, optional fields, null as absent, ranges.
#include "layout/json_reader.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <string>

namespace kvshare::layout {
namespace {

using nlohmann::json;

TEST(JsonReader, NamesTheMessageAndTheNestedFieldByItsPath) {
  const json entry = {{"chunk", "one"}};
  const JsonReader read{entry, "handshake from pid 7", "fds[1]."};
  auto chunk = read.u64("chunk");
  ASSERT_FALSE(chunk);
  EXPECT_EQ(chunk.error().errno_value(), EINVAL);
  EXPECT_EQ(chunk.error().message(), "handshake from pid 7: \"fds[1].chunk\" is \"one\", not an unsigned integer");
  auto kind = read.text("kind");
  ASSERT_FALSE(kind);
  EXPECT_EQ(kind.error().message(), "handshake from pid 7: no \"fds[1].kind\"");
}

TEST(JsonReader, RefusesAnUnsignedValuePastItsMaximumNamingTheRange) {
  const json message = json::parse(R"({"share_id": 10})");
  const JsonReader read{message, "m"};
  auto id = read.u64("share_id", 9);
  ASSERT_FALSE(id);
  EXPECT_EQ(id.error().message(), "m: \"share_id\" is 10, not an integer 0..9");
  EXPECT_EQ(read.u64("share_id", 10).value(), 10u);
}

TEST(JsonReader, ReadsAnAbsentOptionalFieldAsNulloptAndAWrongTypeAsAnError) {
  const json message = json::parse(R"({"stream": 2, "n_cells": "all"})");
  const JsonReader read{message, "m"};
  EXPECT_EQ(read.optional_u64("first_cell", UINT32_MAX).value(), std::nullopt);
  EXPECT_EQ(read.optional_u64("stream", UINT32_MAX).value(), 2u);
  auto cells = read.optional_u64("n_cells", UINT32_MAX);
  ASSERT_FALSE(cells);
  EXPECT_NE(cells.error().message().find("\"n_cells\" is \"all\""), std::string::npos) << cells.error().message();
}

TEST(JsonReader, ReadsNullAsAbsentOnlyWhenTheMessageSaysSo) {
  const json body = {{"stream", nullptr}, {"temperature", nullptr}};
  const JsonReader http{body, "completion request", "", true};
  EXPECT_EQ(http.optional_boolean("stream").value(), std::nullopt);
  EXPECT_EQ(http.optional_number("temperature").value(), std::nullopt);
  const JsonReader channel{body, "m"};
  auto stream = channel.optional_boolean("stream");
  ASSERT_FALSE(stream);
  EXPECT_EQ(stream.error().message(), "m: \"stream\" is null, not true or false");
}

TEST(JsonReader, NamesAStringThatIsNotUtf8WithoutThrowing) {
  const json message = {{"n", std::string("\xC0\xAF")}};
  auto n = JsonReader{message, "m"}.u64("n");
  ASSERT_FALSE(n);
  EXPECT_NE(n.error().message().find("not an unsigned integer"), std::string::npos);
}

}  // namespace
}  // namespace kvshare::layout
