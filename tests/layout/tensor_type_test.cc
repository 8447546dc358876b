#include "layout/tensor_type.h"

#include <gtest/gtest.h>

namespace kvshare::layout {
namespace {

TEST(GgmlRowSize, MatchesGgmlForCacheTypes) {
  EXPECT_EQ(ggml_row_size(GgmlType::F16, 128), 256u);
  EXPECT_EQ(ggml_row_size(GgmlType::F32, 128), 512u);
  EXPECT_EQ(ggml_row_size(GgmlType::Q8_0, 128), 136u);  // 4 blocks of 34 bytes
  EXPECT_EQ(ggml_row_size(GgmlType::Q4_K, 512), 288u);  // 2 super-blocks of 144 bytes
}

TEST(GgmlTypeTraits, RefusesRemovedTypeIds) {
  EXPECT_FALSE(ggml_type_traits(4).has_value());
  EXPECT_FALSE(ggml_type_traits(31).has_value());
  EXPECT_FALSE(ggml_type_traits(-1).has_value());
  EXPECT_TRUE(ggml_type_traits(30).has_value());
}

TEST(ParseCacheType, AcceptsWhatLlamaServerAccepts) {
  EXPECT_EQ(parse_cache_type("q8_0").value(), GgmlType::Q8_0);
  EXPECT_EQ(parse_cache_type("bf16").value(), GgmlType::BF16);
}

TEST(ParseCacheType, NamesTheAllowedListWhenRefusing) {
  auto result = parse_cache_type("q6_K");
  ASSERT_FALSE(result.has_value());
  EXPECT_EQ(result.error().errno_value(), EINVAL);
  EXPECT_NE(result.error().message().find("\"q6_K\""), std::string::npos);
  EXPECT_NE(result.error().message().find("iq4_nl"), std::string::npos);
}

}  // namespace
}  // namespace kvshare::layout
