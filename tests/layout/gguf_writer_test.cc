#include "layout/gguf_writer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "layout/gguf_reader.h"
#include "layout/half.h"

namespace kvshare::layout {
namespace {

// Deep equality of two metadata values (GgufArray has no operator==).
bool same_value(const GgufValue& a, const GgufValue& b) {
  if (a.type() != b.type()) return false;
  if (const auto* array_a = a.get_if<GgufArray>()) {
    const auto* array_b = b.get_if<GgufArray>();
    if (array_a->element_type != array_b->element_type || array_a->elements.size() != array_b->elements.size())
      return false;
    for (size_t i = 0; i < array_a->elements.size(); ++i)
      if (!same_value(array_a->elements[i], array_b->elements[i])) return false;
    return true;
  }
  return std::visit(
      [&b](const auto& x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, GgufArray>) {
          return false;  // handled above
        } else {
          return *b.get_if<T>() == x;
        }
      },
      a.value);
}

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

std::vector<std::byte> bytes_of(std::initializer_list<uint8_t> values) {
  std::vector<std::byte> bytes;
  for (uint8_t v : values) bytes.push_back(std::byte{v});
  return bytes;
}

GgufMetadata every_value_type() {
  GgufMetadata metadata;
  metadata.set("t.u8", value_of<uint8_t>(250));
  metadata.set("t.i8", value_of<int8_t>(-7));
  metadata.set("t.u16", value_of<uint16_t>(65000));
  metadata.set("t.i16", value_of<int16_t>(-32000));
  metadata.set("t.u32", value_of<uint32_t>(4000000000u));
  metadata.set("t.i32", value_of<int32_t>(-2000000000));
  metadata.set("t.f32", value_of<float>(1.5e-3f));
  metadata.set("t.bool.true", value_of<bool>(true));
  metadata.set("t.bool.false", value_of<bool>(false));
  metadata.set("t.string", value_of<std::string>("héllo, GGUF"));
  metadata.set("t.string.empty", value_of<std::string>(""));
  metadata.set("t.u64", value_of<uint64_t>(0xFEDCBA9876543210ull));
  metadata.set("t.i64", value_of<int64_t>(std::numeric_limits<int64_t>::min()));
  metadata.set("t.f64", value_of<double>(-2.718281828459045));
  metadata.set("a.u8", array_value<uint8_t>(GgufValueType::UINT8, {0, 1, 255}));
  metadata.set("a.i8", array_value<int8_t>(GgufValueType::INT8, {-128, 127}));
  metadata.set("a.u16", array_value<uint16_t>(GgufValueType::UINT16, {1, 65535}));
  metadata.set("a.i16", array_value<int16_t>(GgufValueType::INT16, {-1, 2}));
  metadata.set("a.u32", array_value<uint32_t>(GgufValueType::UINT32, {8, 8, 0, 8}));
  metadata.set("a.i32", array_value<int32_t>(GgufValueType::INT32, {-1, 0, 1}));
  metadata.set("a.f32", array_value<float>(GgufValueType::FLOAT32, {0.25f, -1e30f}));
  metadata.set("a.bool", array_value<bool>(GgufValueType::BOOL, {true, false, true}));
  metadata.set("a.string", array_value<std::string>(GgufValueType::STRING, {"<s>", "", "▁the"}));
  metadata.set("a.u64", array_value<uint64_t>(GgufValueType::UINT64, {1ull << 40}));
  metadata.set("a.i64", array_value<int64_t>(GgufValueType::INT64, {-(1ll << 40)}));
  metadata.set("a.f64", array_value<double>(GgufValueType::FLOAT64, {1e300}));
  metadata.set("a.empty", array_value<uint32_t>(GgufValueType::UINT32, {}));
  return metadata;
}

GgufFile parse_or_die(const std::vector<std::byte>& bytes) {
  auto file = parse_gguf(bytes, "test.gguf");
  EXPECT_TRUE(file.has_value()) << (file ? "" : file.error().what());
  return file ? std::move(*file) : GgufFile{};
}

TEST(GgufWriter, RoundTripsEveryValueTypeAndArraysInOrder) {
  GgufWriter writer;
  writer.metadata() = every_value_type();
  auto bytes = writer.finish();
  ASSERT_TRUE(bytes) << bytes.error().what();
  const GgufFile file = parse_or_die(*bytes);

  const GgufMetadata expected_metadata = every_value_type();
  const auto& expected = expected_metadata.entries();
  ASSERT_EQ(file.metadata.entries().size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(file.metadata.entries()[i].first, expected[i].first);
    EXPECT_TRUE(same_value(file.metadata.entries()[i].second, expected[i].second)) << expected[i].first;
  }
  EXPECT_EQ(file.version, 3u);
  EXPECT_TRUE(file.tensors.empty());
}

TEST(GgufWriter, AddHelpersStoreTheTypesLlamaCppReads) {
  GgufWriter writer;
  writer.add_u32("llama.block_count", 2);
  writer.add_i32("x.i32", -3);
  writer.add_u64("x.u64", 1ull << 33);
  writer.add_f32("llama.rope.freq_base", 10000.0f);
  writer.add_bool("x.bool", true);
  writer.add_string("general.architecture", "llama");
  writer.add_string_array("tokenizer.ggml.tokens", {"a", "b"});
  writer.add_u32_array("x.u32s", {1, 2});
  writer.add_i32_array("llama.attention.head_count_kv", {4, 0});
  writer.add_f32_array("tokenizer.ggml.scores", {0.5f, -0.5f});
  writer.add_bool_array("x.bools", {false, true});
  auto bytes = writer.finish();
  ASSERT_TRUE(bytes) << bytes.error().what();
  const GgufFile file = parse_or_die(*bytes);

  EXPECT_EQ(file.metadata.get_u32("llama.block_count").value(), 2u);
  EXPECT_EQ(*file.metadata.find("x.i32")->get_if<int32_t>(), -3);
  EXPECT_EQ(*file.metadata.find("x.u64")->get_if<uint64_t>(), 1ull << 33);
  EXPECT_EQ(file.metadata.get_f32("llama.rope.freq_base").value(), 10000.0f);
  EXPECT_TRUE(file.metadata.get_bool("x.bool").value());
  EXPECT_EQ(file.metadata.get_string("general.architecture").value(), "llama");
  const GgufArray* tokens = file.metadata.get_array("tokenizer.ggml.tokens").value();
  EXPECT_EQ(tokens->element_type, GgufValueType::STRING);
  EXPECT_EQ(*tokens->elements[1].get_if<std::string>(), "b");
  EXPECT_EQ(file.metadata.get_array("x.u32s").value()->element_type, GgufValueType::UINT32);
  EXPECT_EQ(file.metadata.find_per_layer("llama.attention.head_count_kv", 2).value(), (std::vector<uint32_t>{4, 0}));
  EXPECT_EQ(*file.metadata.get_array("tokenizer.ggml.scores").value()->elements[1].get_if<float>(), -0.5f);
  EXPECT_EQ(file.metadata.find_per_layer("x.bools", 2).value(), (std::vector<uint32_t>{0, 1}));
}

TEST(GgufWriter, StartsEveryTensorOnTheDefaultAlignmentOf32) {
  GgufWriter writer;
  writer.add_string("general.architecture", "llama");
  const std::vector<float> a{1, 2, 3};  // 12 bytes: the next tensor needs 20 bytes of padding
  const std::vector<float> b{4, 5, 6, 7, 8};
  ASSERT_TRUE(writer.add_tensor_from_f32("a", GgmlType::F32, {3}, a));
  ASSERT_TRUE(writer.add_tensor_from_f32("b", GgmlType::F32, {5, 1}, b));
  auto bytes = writer.finish();
  ASSERT_TRUE(bytes) << bytes.error().what();
  const GgufFile file = parse_or_die(*bytes);

  EXPECT_EQ(file.alignment, 32u);
  EXPECT_EQ(file.data_offset % 32, 0u);
  ASSERT_EQ(file.tensors.size(), 2u);
  EXPECT_EQ(file.tensors[0].offset, 0u);
  EXPECT_EQ(file.tensors[1].offset, 32u);
  EXPECT_EQ(file.tensors[1].n_dims, 2u);
  EXPECT_EQ(file.data_size, 64u);
  EXPECT_EQ(bytes->size(), file.data_offset + 64);
  EXPECT_TRUE(file.has_tensor_data());
  auto data_b = tensor_data(file, file.tensors[1]);
  ASSERT_TRUE(data_b);
  ASSERT_EQ(data_b->size(), 20u);
  EXPECT_EQ(std::memcmp(data_b->data(), b.data(), 20), 0);
  // Padding is zeros.
  for (size_t i = file.data_offset + 12; i < file.data_offset + 32; ++i) EXPECT_EQ((*bytes)[i], std::byte{0});
}

TEST(GgufWriter, HonoursACustomAlignmentForTheDataSectionAndEveryTensor) {
  GgufWriter writer;
  ASSERT_TRUE(writer.set_alignment(256));
  const std::vector<float> values(40, 1.0f);
  ASSERT_TRUE(writer.add_tensor_from_f32("x", GgmlType::F16, {40}, values));
  ASSERT_TRUE(writer.add_tensor_from_f32("y", GgmlType::F16, {8, 5}, values));
  auto bytes = writer.finish();
  ASSERT_TRUE(bytes) << bytes.error().what();
  const GgufFile file = parse_or_die(*bytes);

  EXPECT_EQ(file.alignment, 256u);
  EXPECT_EQ(file.metadata.get_u32("general.alignment").value(), 256u);
  EXPECT_EQ(file.data_offset % 256, 0u);
  EXPECT_EQ(file.tensors[1].offset, 256u);
  EXPECT_EQ(bytes->size(), file.data_offset + 512);
}

TEST(GgufWriter, RefusesAnAlignmentThatIsNotAPowerOfTwo) {
  GgufWriter writer;
  auto result = writer.set_alignment(48);
  ASSERT_FALSE(result);
  EXPECT_EQ(result.error().errno_value(), EINVAL);
  EXPECT_NE(result.error().message().find("48 is not a power of 2"), std::string::npos);
  EXPECT_FALSE(writer.set_alignment(0));
}

TEST(GgufWriter, RefusesAGeneralAlignmentKeyOfAnotherTypeWhenWriting) {
  GgufWriter writer;
  writer.add_i32("general.alignment", 64);
  auto bytes = writer.finish();
  ASSERT_FALSE(bytes);
  EXPECT_EQ(bytes.error().errno_value(), EINVAL);
  EXPECT_NE(bytes.error().message().find("\"general.alignment\" has type i32, must be u32"), std::string::npos);
}

TEST(GgufWriter, EncodesF16AndBf16WithGgmlRounding) {
  GgufWriter writer;
  const std::vector<float> values{1.0f, -2.0f, 65504.0f, 1.0f + 0x1.0p-11f};
  ASSERT_TRUE(writer.add_tensor_from_f32("h", GgmlType::F16, {4}, values));
  ASSERT_TRUE(writer.add_tensor_from_f32("b", GgmlType::BF16, {4}, values));
  auto bytes = writer.finish();
  ASSERT_TRUE(bytes);
  const GgufFile file = parse_or_die(*bytes);
  auto h = tensor_data(file, file.tensors[0]).value();
  auto b = tensor_data(file, file.tensors[1]).value();
  uint16_t h_bits[4];
  uint16_t b_bits[4];
  std::memcpy(h_bits, h.data(), 8);
  std::memcpy(b_bits, b.data(), 8);
  EXPECT_EQ(h_bits[0], 0x3C00);
  EXPECT_EQ(h_bits[1], 0xC000);
  EXPECT_EQ(h_bits[2], 0x7BFF);
  EXPECT_EQ(h_bits[3], 0x3C00);  // exactly half an f16 ulp above 1: ties to even
  EXPECT_EQ(b_bits[0], 0x3F80);
  EXPECT_EQ(b_bits[1], 0xC000);
}

TEST(GgufWriter, QuantizesQ8_0AsGgmlsReferenceWithRoundHalfAwayFromZero) {
  // amax 127 makes d exactly 1, so q is roundf(x): 2.5 -> 3 and -2.5 -> -3 (not to even).
  std::vector<float> block(32, 0.0f);
  block[0] = 127.0f;
  block[1] = 2.5f;
  block[2] = -2.5f;
  block[3] = 0.5f;
  block[4] = -0.49f;
  block[5] = -127.0f;
  auto encoded = encode_f32_as(GgmlType::Q8_0, block);
  ASSERT_TRUE(encoded) << encoded.error().what();
  ASSERT_EQ(encoded->size(), 34u);
  const std::vector<std::byte>& out = *encoded;
  uint16_t d_bits = 0;
  std::memcpy(&d_bits, out.data(), 2);
  EXPECT_EQ(d_bits, 0x3C00);  // 1.0 in f16
  const auto q = [&](int j) { return static_cast<int8_t>(out[2 + j]); };
  EXPECT_EQ(q(0), 127);
  EXPECT_EQ(q(1), 3);
  EXPECT_EQ(q(2), -3);
  EXPECT_EQ(q(3), 1);
  EXPECT_EQ(q(4), 0);
  EXPECT_EQ(q(5), -127);
  EXPECT_EQ(q(31), 0);
}

TEST(GgufWriter, QuantizesQ8_0WithScaleAmaxOver127StoredAsF16) {
  std::vector<float> block(32);
  for (int j = 0; j < 32; ++j) block[j] = static_cast<float>(j - 16);  // amax 16
  auto bytes = encode_f32_as(GgmlType::Q8_0, block);
  ASSERT_TRUE(bytes);
  ASSERT_EQ(bytes->size(), 34u);
  uint16_t d_bits = 0;
  std::memcpy(&d_bits, bytes->data(), 2);
  EXPECT_EQ(d_bits, fp32_to_fp16(16.0f / 127.0f));
  // id = 1 / (16/127) = 7.9375: x = 1 -> 7.9375 -> 8; x = 15 -> 119.06 -> 119; x = -16 -> -127.
  EXPECT_EQ(static_cast<int8_t>((*bytes)[2 + 17]), 8);
  EXPECT_EQ(static_cast<int8_t>((*bytes)[2 + 31]), 119);
  EXPECT_EQ(static_cast<int8_t>((*bytes)[2 + 0]), -127);
}

TEST(GgufWriter, WritesAllZeroQ8_0BlocksWithAZeroScale) {
  std::vector<float> zeros(64, 0.0f);
  auto bytes = encode_f32_as(GgmlType::Q8_0, zeros);
  ASSERT_TRUE(bytes);
  for (std::byte b : *bytes) EXPECT_EQ(b, std::byte{0});
}

TEST(GgufWriter, RefusesToEncodeNonFiniteValues) {
  const std::vector<float> values{1.0f, std::numeric_limits<float>::infinity()};
  auto bytes = encode_f32_as(GgmlType::F16, values);
  ASSERT_FALSE(bytes);
  EXPECT_EQ(bytes.error().errno_value(), EINVAL);
  EXPECT_NE(bytes.error().message().find("value 1 is inf"), std::string::npos);
}

TEST(GgufWriter, RefusesToEncodeFloatsAsATypeItCannotQuantize) {
  const std::vector<float> values(32, 1.0f);
  auto bytes = encode_f32_as(GgmlType::Q4_K, values);
  ASSERT_FALSE(bytes);
  EXPECT_NE(bytes.error().message().find("q4_K"), std::string::npos);
}

TEST(GgufWriter, KeepsRawQ8_0BytesAndItsBlockGeometry) {
  GgufWriter writer;
  std::vector<std::byte> raw(2 * 34);
  for (size_t i = 0; i < raw.size(); ++i) raw[i] = std::byte(static_cast<uint8_t>(i * 7));
  ASSERT_TRUE(writer.add_tensor("q", GgmlType::Q8_0, {64}, raw));
  auto bytes = writer.finish();
  ASSERT_TRUE(bytes);
  const GgufFile file = parse_or_die(*bytes);
  EXPECT_EQ(file.tensors[0].size_bytes, 68u);
  auto data = tensor_data(file, file.tensors[0]).value();
  EXPECT_TRUE(std::equal(data.begin(), data.end(), raw.begin(), raw.end()));
}

TEST(GgufWriter, RefusesRawDataOfTheWrongSizeNamingTheTensor) {
  GgufWriter writer;
  std::vector<std::byte> raw(10);
  auto result = writer.add_tensor("blk.0.w", GgmlType::F16, {4, 2}, raw);
  ASSERT_FALSE(result);
  EXPECT_EQ(result.error().errno_value(), EINVAL);
  EXPECT_NE(result.error().message().find("tensor \"blk.0.w\": 10 bytes of data, its shape and type take 16"),
            std::string::npos);
}

TEST(GgufWriter, RefusesARowThatIsNotAMultipleOfTheBlockSize) {
  GgufWriter writer;
  auto result = writer.add_tensor_shape("q", GgmlType::Q8_0, {33, 2});
  ASSERT_FALSE(result);
  EXPECT_NE(result.error().message().find("33 elements per row, not a multiple of its block size 32"),
            std::string::npos);
}

TEST(GgufWriter, RefusesDuplicateAndOverlongTensorNames) {
  GgufWriter writer;
  ASSERT_TRUE(writer.add_tensor_shape("w", GgmlType::F32, {1}));
  auto duplicate = writer.add_tensor_shape("w", GgmlType::F32, {1});
  ASSERT_FALSE(duplicate);
  EXPECT_NE(duplicate.error().message().find("duplicate tensor name"), std::string::npos);
  auto overlong = writer.add_tensor_shape(std::string(64, 'n'), GgmlType::F32, {1});
  ASSERT_FALSE(overlong);
  EXPECT_NE(overlong.error().message().find("64 bytes"), std::string::npos);
  EXPECT_TRUE(writer.add_tensor_shape(std::string(63, 'n'), GgmlType::F32, {1}));
}

TEST(GgufWriter, RefusesTensorsWithNoOrMoreThanFourDimensions) {
  GgufWriter writer;
  EXPECT_FALSE(writer.add_tensor_shape("none", GgmlType::F32, {}));
  auto five = writer.add_tensor_shape("five", GgmlType::F32, {1, 1, 1, 1, 1});
  ASSERT_FALSE(five);
  EXPECT_NE(five.error().message().find("5 dimensions"), std::string::npos);
}

TEST(GgufWriter, RefusesAnArrayOfArraysWhenWriting) {
  GgufWriter writer;
  GgufArray inner;
  GgufArray outer;
  outer.element_type = GgufValueType::ARRAY;
  outer.elements.push_back(GgufValue{GgufValue::Storage(inner)});
  writer.set("nested", GgufValue{GgufValue::Storage(outer)});
  auto bytes = writer.finish();
  ASSERT_FALSE(bytes);
  EXPECT_NE(bytes.error().message().find("key \"nested\": arrays of arrays"), std::string::npos);
}

TEST(GgufWriter, RefusesAnArrayWhoseElementsAreNotItsElementType) {
  GgufWriter writer;
  GgufArray array;
  array.element_type = GgufValueType::UINT32;
  array.elements.push_back(value_of<uint32_t>(1));
  array.elements.push_back(value_of<int32_t>(2));
  writer.set("mixed", GgufValue{GgufValue::Storage(array)});
  auto bytes = writer.finish();
  ASSERT_FALSE(bytes);
  EXPECT_NE(bytes.error().message().find("element 1 is i32, the array holds u32"), std::string::npos);
}

TEST(GgufWriter, RefusesAnEmptyKey) {
  GgufWriter writer;
  writer.add_u32("", 1);
  auto bytes = writer.finish();
  ASSERT_FALSE(bytes);
  EXPECT_NE(bytes.error().message().find("empty"), std::string::npos);
}

TEST(GgufWriter, WritesAShapeOnlyFileThatParsesWithoutData) {
  GgufWriter writer;
  writer.add_string("general.architecture", "qwen3moe");
  ASSERT_TRUE(writer.add_tensor_shape("token_embd.weight", GgmlType::Q8_0, {2048, 151936}));
  ASSERT_TRUE(writer.add_tensor_shape("output_norm.weight", GgmlType::F32, {2048}));
  auto bytes = writer.finish(GgufPayload::kMetaOnly);
  ASSERT_TRUE(bytes) << bytes.error().what();
  EXPECT_LT(bytes->size(), 512u);
  const GgufFile file = parse_or_die(*bytes);

  EXPECT_EQ(bytes->size(), file.data_offset);  // ends with the padding, as ggml's only_meta
  EXPECT_EQ(file.data_offset % 32, 0u);
  EXPECT_FALSE(file.has_tensor_data());
  EXPECT_EQ(file.tensors[0].size_bytes, 2048u / 32 * 34 * 151936);
  EXPECT_EQ(file.tensors[1].offset, gguf_pad(file.tensors[0].size_bytes, 32));
  auto data = tensor_data(file, file.tensors[0]);
  ASSERT_FALSE(data);
  EXPECT_EQ(data.error().errno_value(), ENODATA);
  EXPECT_NE(data.error().message().find("tensor \"token_embd.weight\""), std::string::npos);
}

TEST(GgufWriter, RefusesToWriteDataForATensorAddedAsShapeOnly) {
  GgufWriter writer;
  ASSERT_TRUE(writer.add_tensor_shape("w", GgmlType::F32, {4}));
  auto bytes = writer.finish();
  ASSERT_FALSE(bytes);
  EXPECT_EQ(bytes.error().errno_value(), EINVAL);
  EXPECT_NE(bytes.error().message().find("tensor \"w\" has no data"), std::string::npos);
}

TEST(GgufWriter, WritesTheMetaOnlyFileAsThePrefixOfTheFullFile) {
  GgufWriter writer;
  writer.add_u32("general.alignment", 64);
  const std::vector<float> values(64, 0.5f);
  ASSERT_TRUE(writer.add_tensor_from_f32("w", GgmlType::Q8_0, {64}, values));
  auto full = writer.finish();
  auto meta = writer.finish(GgufPayload::kMetaOnly);
  ASSERT_TRUE(full && meta);
  ASSERT_LT(meta->size(), full->size());
  EXPECT_TRUE(std::equal(meta->begin(), meta->end(), full->begin()));
  EXPECT_EQ(writer.size_bytes(GgufPayload::kMetaOnly).value(), meta->size());
  EXPECT_EQ(writer.size_bytes().value(), full->size());
}

TEST(GgufWriter, StreamsGeneratedTensorsToTheSinkInFileOrder) {
  GgufWriter writer;
  int fill_calls = 0;
  ASSERT_TRUE(writer.add_tensor_generated("g", GgmlType::I8, {5, 3}, [&](std::span<std::byte> out) -> Result<void> {
    ++fill_calls;
    for (size_t i = 0; i < out.size(); ++i) out[i] = std::byte(static_cast<uint8_t>(i + 1));
    return {};
  }));
  std::vector<std::byte> streamed;
  size_t n_chunks = 0;
  auto ok = writer.write([&](std::span<const std::byte> chunk) -> Result<void> {
    ++n_chunks;
    streamed.insert(streamed.end(), chunk.begin(), chunk.end());
    return {};
  });
  ASSERT_TRUE(ok) << ok.error().what();
  EXPECT_EQ(fill_calls, 1);
  EXPECT_EQ(n_chunks, 3u);  // header, data, padding
  const GgufFile file = parse_or_die(streamed);
  auto data = tensor_data(file, file.tensors[0]).value();
  ASSERT_EQ(data.size(), 15u);
  EXPECT_EQ(data[14], std::byte{15});
  auto again = writer.finish();
  ASSERT_TRUE(again);
  EXPECT_EQ(*again, streamed);
}

TEST(GgufWriter, StopsAndReturnsTheSinksError) {
  GgufWriter writer;
  ASSERT_TRUE(writer.add_tensor("w", GgmlType::I8, {4}, bytes_of({1, 2, 3, 4})));
  int calls = 0;
  auto ok = writer.write([&](std::span<const std::byte>) -> Result<void> {
    if (++calls == 2) return fail(ENOSPC, "write to model.gguf at offset 96");
    return {};
  });
  ASSERT_FALSE(ok);
  EXPECT_EQ(ok.error().errno_value(), ENOSPC);
  EXPECT_EQ(calls, 2);
}

TEST(GgufWriter, PassesOnAFillFunctionsErrorNamingTheTensor) {
  GgufWriter writer;
  ASSERT_TRUE(writer.add_tensor_generated(
      "blk.3.ffn_up.weight", GgmlType::F32, {8},
      [](std::span<std::byte>) -> Result<void> { return fail(EIO, "weight generator out of entropy"); }));
  auto bytes = writer.finish();
  ASSERT_FALSE(bytes);
  EXPECT_EQ(bytes.error().errno_value(), EIO);
  EXPECT_NE(bytes.error().message().find("tensor \"blk.3.ffn_up.weight\": weight generator"), std::string::npos);
}

TEST(GgufWriter, WritesVersion2WhenAskedAndRefusesOtherVersions) {
  GgufWriter writer;
  ASSERT_TRUE(writer.set_version(2));
  auto bytes = writer.finish();
  ASSERT_TRUE(bytes);
  EXPECT_EQ(parse_or_die(*bytes).version, 2u);
  EXPECT_FALSE(writer.set_version(1));
  EXPECT_FALSE(writer.set_version(4));
}

TEST(GgufWriter, ReencodesAParsedFileToTheSameBytes) {
  GgufWriter writer;
  writer.metadata() = every_value_type();
  ASSERT_TRUE(writer.set_alignment(64));
  const std::vector<float> values(96, -0.75f);
  ASSERT_TRUE(writer.add_tensor_from_f32("a", GgmlType::BF16, {32, 3}, values));
  ASSERT_TRUE(writer.add_tensor_from_f32("b", GgmlType::Q8_0, {96}, values));
  auto bytes = writer.finish();
  ASSERT_TRUE(bytes);
  const GgufFile file = parse_or_die(*bytes);
  auto copy = GgufWriter::from_file(file);
  ASSERT_TRUE(copy) << copy.error().what();
  auto again = copy->finish();
  ASSERT_TRUE(again) << again.error().what();
  EXPECT_EQ(*again, *bytes);
}

}  // namespace
}  // namespace kvshare::layout
