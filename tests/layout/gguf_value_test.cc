#include "layout/gguf_value.h"

#include <gtest/gtest.h>

namespace kvshare::layout {
namespace {

template <class T>
GgufValue value_of(T v) {
  return GgufValue{GgufValue::Storage(std::in_place_type<T>, std::move(v))};
}

template <class T>
GgufValue array_value(GgufValueType element_type, std::vector<T> values) {
  GgufArray array;
  array.element_type = element_type;
  for (T v : values) array.elements.push_back(value_of<T>(std::move(v)));
  return GgufValue{GgufValue::Storage(std::move(array))};
}

TEST(GgufValueTypeName, UsesGgmlsShortNames) {
  EXPECT_EQ(gguf_value_type_name(GgufValueType::UINT32), "u32");
  EXPECT_EQ(gguf_value_type_name(GgufValueType::STRING), "str");
  EXPECT_EQ(gguf_value_type_name(GgufValueType::ARRAY), "arr");
  EXPECT_EQ(gguf_value_type_name(GgufValueType::FLOAT64), "f64");
  EXPECT_EQ(gguf_value_type_name(static_cast<GgufValueType>(99)), "unknown");
}

TEST(GgufValue, ReportsTheGgufTypeOfItsAlternative) {
  EXPECT_EQ(value_of<int16_t>(1).type(), GgufValueType::INT16);
  EXPECT_EQ(value_of<bool>(true).type(), GgufValueType::BOOL);
  EXPECT_EQ(value_of<double>(1).type(), GgufValueType::FLOAT64);
  EXPECT_EQ(array_value<uint8_t>(GgufValueType::UINT8, {}).type(), GgufValueType::ARRAY);
}

TEST(GgufMetadata, ReplacesAKeyInPlaceWhenSetAgain) {
  GgufMetadata metadata;
  metadata.set("a", value_of<uint32_t>(1));
  metadata.set("b", value_of<uint32_t>(2));
  metadata.set("a", value_of<uint32_t>(3));
  ASSERT_EQ(metadata.entries().size(), 2u);
  EXPECT_EQ(metadata.entries()[0].first, "a");
  EXPECT_EQ(metadata.get_u32("a").value(), 3u);
}

TEST(GgufMetadata, NamesAMissingKeyWithEnoent) {
  GgufMetadata metadata;
  auto value = metadata.get_u32("llama.block_count");
  ASSERT_FALSE(value);
  EXPECT_EQ(value.error().errno_value(), ENOENT);
  EXPECT_NE(value.error().message().find("\"llama.block_count\" not found"), std::string::npos);
}

TEST(GgufMetadata, RefusesAKeyOfAnotherTypeAsLlamaCppDoes) {
  GgufMetadata metadata;
  metadata.set("llama.block_count", value_of<int32_t>(32));
  auto value = metadata.get_u32("llama.block_count");
  ASSERT_FALSE(value);
  EXPECT_EQ(value.error().errno_value(), EINVAL);
  EXPECT_NE(value.error().message().find("\"llama.block_count\" has wrong type i32 but expected type u32"),
            std::string::npos);
}

TEST(GgufMetadata, GetsEachStrictlyTypedScalar) {
  GgufMetadata metadata;
  metadata.set("f", value_of<float>(0.5f));
  metadata.set("b", value_of<bool>(true));
  metadata.set("s", value_of<std::string>("llama"));
  EXPECT_EQ(metadata.get_f32("f").value(), 0.5f);
  EXPECT_TRUE(metadata.get_bool("b").value());
  EXPECT_EQ(metadata.get_string("s").value(), "llama");
  EXPECT_FALSE(metadata.get_string("f"));
  EXPECT_FALSE(metadata.get_bool("s"));
}

TEST(GgufMetadata, NamesTheElementTypeWhenAnArrayIsNotTheScalarAskedFor) {
  GgufMetadata metadata;
  metadata.set("n", array_value<uint32_t>(GgufValueType::UINT32, {1}));
  auto value = metadata.get_u32("n");
  ASSERT_FALSE(value);
  EXPECT_NE(value.error().message().find("wrong type arr[u32]"), std::string::npos);
}

TEST(GgufMetadata, FindsOptionalKeysStrictly) {
  GgufMetadata metadata;
  metadata.set("u", value_of<uint32_t>(7));
  metadata.set("wrong", value_of<uint64_t>(7));
  EXPECT_EQ(metadata.find_u32("u").value(), std::optional<uint32_t>(7));
  EXPECT_EQ(metadata.find_u32("absent").value(), std::nullopt);
  EXPECT_EQ(metadata.find_f32("absent").value(), std::nullopt);
  EXPECT_FALSE(metadata.find_u32("wrong"));
}

TEST(GgufMetadata, GetsAnArrayOrRefusesAScalar) {
  GgufMetadata metadata;
  metadata.set("a", array_value<float>(GgufValueType::FLOAT32, {1.0f, 2.0f}));
  metadata.set("s", value_of<uint32_t>(1));
  EXPECT_EQ(metadata.get_array("a").value()->elements.size(), 2u);
  auto scalar = metadata.get_array("s");
  ASSERT_FALSE(scalar);
  EXPECT_NE(scalar.error().message().find("has wrong type u32 but expected type arr"), std::string::npos);
  EXPECT_EQ(metadata.get_array("absent").error().errno_value(), ENOENT);
}

TEST(GgufMetadataPerLayer, BroadcastsAU32ScalarToEveryLayer) {
  GgufMetadata metadata;
  metadata.set("llama.attention.head_count_kv", value_of<uint32_t>(8));
  EXPECT_EQ(metadata.find_per_layer("llama.attention.head_count_kv", 3).value(), (std::vector<uint32_t>{8, 8, 8}));
}

TEST(GgufMetadataPerLayer, IsAbsentWhenTheKeyIsMissing) {
  GgufMetadata metadata;
  EXPECT_EQ(metadata.find_per_layer("x", 4).value(), std::nullopt);
}

TEST(GgufMetadataPerLayer, RefusesAnI32ScalarAsLlamaCppsGetKeyDoes) {
  GgufMetadata metadata;
  metadata.set("x", value_of<int32_t>(8));
  auto per_layer = metadata.find_per_layer("x", 2);
  ASSERT_FALSE(per_layer);
  EXPECT_EQ(per_layer.error().errno_value(), EINVAL);
  EXPECT_NE(per_layer.error().message().find("wrong type i32"), std::string::npos);
}

TEST(GgufMetadataPerLayer, ReadsU32I32AndBoolArrays) {
  GgufMetadata metadata;
  metadata.set("u", array_value<uint32_t>(GgufValueType::UINT32, {1, 2}));
  metadata.set("i", array_value<int32_t>(GgufValueType::INT32, {0, -1}));
  metadata.set("b", array_value<bool>(GgufValueType::BOOL, {true, false}));
  EXPECT_EQ(metadata.find_per_layer("u", 2).value(), (std::vector<uint32_t>{1, 2}));
  EXPECT_EQ(metadata.find_per_layer("i", 2).value(), (std::vector<uint32_t>{0, 0xFFFFFFFFu}));
  EXPECT_EQ(metadata.find_per_layer("b", 2).value(), (std::vector<uint32_t>{1, 0}));
}

TEST(GgufMetadataPerLayer, RefusesAnArrayOfTheWrongLength) {
  GgufMetadata metadata;
  metadata.set("x", array_value<uint32_t>(GgufValueType::UINT32, {1, 2, 3}));
  auto per_layer = metadata.find_per_layer("x", 4);
  ASSERT_FALSE(per_layer);
  EXPECT_NE(per_layer.error().message().find("wrong array length; expected 4, got 3"), std::string::npos);
}

TEST(GgufMetadataPerLayer, RefusesAnArrayOfFloats) {
  GgufMetadata metadata;
  metadata.set("x", array_value<float>(GgufValueType::FLOAT32, {1.0f}));
  auto per_layer = metadata.find_per_layer("x", 1);
  ASSERT_FALSE(per_layer);
  EXPECT_NE(per_layer.error().message().find("array of f32"), std::string::npos);
}

}  // namespace
}  // namespace kvshare::layout
