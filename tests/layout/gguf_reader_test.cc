#include "layout/gguf_reader.h"

#include <gtest/gtest.h>

#include <string>

#include "layout/gguf_test_bytes.h"
#include "layout/gguf_writer.h"

namespace kvshare::layout {
namespace {

using testing::GgufBytes;

constexpr int32_t kF32 = 0;
constexpr int32_t kQ8_0 = 8;

// Expects an EINVAL refusal whose message holds every one of `words`.
void expect_refused(std::span<const std::byte> bytes, std::initializer_list<std::string> words) {
  auto file = parse_gguf(bytes, "bad.gguf");
  ASSERT_FALSE(file.has_value()) << "parsed a malformed file";
  EXPECT_EQ(file.error().errno_value(), EINVAL) << file.error().what();
  EXPECT_NE(file.error().message().find("GGUF bad.gguf: "), std::string::npos) << file.error().message();
  for (const std::string& word : words)
    EXPECT_NE(file.error().message().find(word), std::string::npos)
        << "missing \"" << word << "\" in: " << file.error().message();
}

// A valid file of two keys and two tensors with data, from the writer.
std::vector<std::byte> small_valid_file() {
  GgufWriter writer;
  writer.add_string("general.architecture", "llama");
  writer.add_u32_array("llama.attention.head_count_kv", {2, 2});
  const std::vector<float> a(32, 0.25f);
  const std::vector<float> b{1, 2, 3};
  EXPECT_TRUE(writer.add_tensor_from_f32("a", GgmlType::Q8_0, {32}, a));
  EXPECT_TRUE(writer.add_tensor_from_f32("b", GgmlType::F32, {3}, b));
  return writer.finish().value();
}

TEST(GgufReader, ParsesAHandBuiltFileFieldByField) {
  GgufBytes bytes;
  bytes.header(3, 1, 2).kv_u32("llama.block_count", 7).str("general.name").i32(8).str("tiny");
  bytes.tensor("w", {4, 2}, kF32, 0).pad_to(32);
  const size_t data_offset = bytes.size();
  bytes.zeros(32);
  auto file = parse_gguf(bytes.span(), "hand.gguf");
  ASSERT_TRUE(file) << file.error().what();
  EXPECT_EQ(file->name, "hand.gguf");
  EXPECT_EQ(file->version, 3u);
  EXPECT_EQ(file->metadata.get_u32("llama.block_count").value(), 7u);
  EXPECT_EQ(file->metadata.get_string("general.name").value(), "tiny");
  ASSERT_EQ(file->tensors.size(), 1u);
  EXPECT_EQ(file->tensors[0].name, "w");
  EXPECT_EQ(file->tensors[0].n_dims, 2u);
  EXPECT_EQ(file->tensors[0].ne, (std::array<int64_t, 4>{4, 2, 1, 1}));
  EXPECT_EQ(file->tensors[0].size_bytes, 32u);
  EXPECT_EQ(file->data_offset, data_offset);
  EXPECT_EQ(file->data_size, 32u);
  EXPECT_TRUE(file->has_tensor_data());
  EXPECT_EQ(tensor_data(*file, file->tensors[0]).value().data(), bytes.bytes().data() + data_offset);
  EXPECT_EQ(file->find_tensor("w"), &file->tensors[0]);
  EXPECT_EQ(file->find_tensor("v"), nullptr);
}

TEST(GgufReader, ReadsVersion2LikeVersion3) {
  GgufBytes bytes;
  bytes.header(2, 0, 1).kv_u32("k", 1);
  auto file = parse_gguf(bytes.span(), "v2.gguf");
  ASSERT_TRUE(file) << file.error().what();
  EXPECT_EQ(file->version, 2u);
}

TEST(GgufReader, LeavesTheDataOffsetUnpaddedWhenThereAreNoTensors) {
  // gguf_init_from_reader seeks to the aligned offset only when n_tensors > 0.
  GgufBytes bytes;
  bytes.header(3, 0, 1).kv_u32("k", 1);
  auto file = parse_gguf(bytes.span(), "none.gguf");
  ASSERT_TRUE(file);
  EXPECT_EQ(file->data_offset, bytes.size());
  EXPECT_EQ(file->data_size, 0u);
}

TEST(GgufReader, RefusesEveryTruncationBeforeTheDataSection) {
  const std::vector<std::byte> bytes = small_valid_file();
  const GgufFile whole = parse_gguf(bytes, "whole").value();
  for (size_t n = 0; n < whole.data_offset; ++n) {
    auto file = parse_gguf(std::span(bytes).first(n), "cut.gguf");
    ASSERT_FALSE(file) << "a file cut at " << n << " bytes parsed";
    EXPECT_EQ(file.error().errno_value(), EINVAL);
    EXPECT_NE(file.error().message().find("byte offset"), std::string::npos) << file.error().message();
  }
}

TEST(GgufReader, ParsesAFileCutInsideTheDataSectionButRefusesTheMissingTensorData) {
  const std::vector<std::byte> bytes = small_valid_file();
  const GgufFile whole = parse_gguf(bytes, "whole").value();
  for (size_t n = whole.data_offset; n < bytes.size(); ++n) {
    auto file = parse_gguf(std::span(bytes).first(n), "cut.gguf");
    ASSERT_TRUE(file) << file.error().what();
    EXPECT_FALSE(file->has_tensor_data());
    for (const GgufTensorInfo& tensor : file->tensors) {
      auto data = tensor_data(*file, tensor);
      const bool is_present = file->data_offset + tensor.offset + tensor.size_bytes <= n;
      ASSERT_EQ(data.has_value(), is_present) << "cut at " << n << ", tensor " << tensor.name;
      if (!data) {
        EXPECT_EQ(data.error().errno_value(), ENODATA);
        EXPECT_NE(data.error().message().find("tensor \"" + tensor.name + "\""), std::string::npos);
        EXPECT_NE(data.error().message().find(fmt::format("({} bytes)", n)), std::string::npos);
      }
    }
  }
}

TEST(GgufReader, NamesTheKeyAndOffsetOfATruncatedValue) {
  GgufBytes bytes;
  bytes.header(3, 0, 1).str("llama.block_count").i32(4).u8(7);  // 1 of 4 bytes
  expect_refused(bytes.span(), {"key \"llama.block_count\"", "a u32 value", "byte offset 53"});
}

TEST(GgufReader, RefusesAWrongMagic) {
  GgufBytes bytes;
  bytes.header(3, 0, 0);
  auto data = bytes.bytes();
  data[3] = std::byte{'X'};
  expect_refused(data, {"invalid magic 'GGUX'", "byte offset 0"});
}

TEST(GgufReader, RefusesVersion0) {
  GgufBytes bytes;
  bytes.header(0, 0, 0);
  expect_refused(bytes.span(), {"bad GGUF version 0", "byte offset 4"});
}

TEST(GgufReader, RefusesVersion1WhoseCountsWere32Bits) {
  GgufBytes bytes;
  bytes.header(1, 0, 0);
  expect_refused(bytes.span(), {"version 1 is no longer supported"});
}

TEST(GgufReader, RefusesVersion4AsNewerThanSupported) {
  GgufBytes bytes;
  bytes.header(4, 0, 0);
  expect_refused(bytes.span(), {"version 4 is newer", "3"});
}

TEST(GgufReader, RecognisesAByteSwappedVersionAsTheOtherEndianness) {
  GgufBytes bytes;
  bytes.header(0x03000000, 0, 0);
  expect_refused(bytes.span(), {"endianness"});
}

TEST(GgufReader, RefusesANegativeKeyCount) {
  GgufBytes bytes;
  bytes.header(3, 0, -1);
  expect_refused(bytes.span(), {"n_kv is -1", "byte offset 16"});
}

TEST(GgufReader, RefusesAHugeKeyCountWithoutAllocatingForIt) {
  GgufBytes bytes;
  bytes.header(3, 0, int64_t{1} << 62).kv_u32("k", 1);
  expect_refused(bytes.span(), {"n_kv is 4611686018427387904", "bytes left hold at most 1", "byte offset 16"});
}

TEST(GgufReader, RefusesAHugeTensorCountWithoutAllocatingForIt) {
  GgufBytes bytes;
  bytes.header(3, std::numeric_limits<int64_t>::max(), 0);
  expect_refused(bytes.span(), {"n_tensors is 9223372036854775807", "byte offset 8"});
}

TEST(GgufReader, RefusesAHugeArrayCountWithoutAllocatingForIt) {
  GgufBytes bytes;
  bytes.header(3, 0, 1).str("tokenizer.ggml.scores").i32(9).i32(6).u64(1000000).zeros(16);
  expect_refused(bytes.span(), {"key \"tokenizer.ggml.scores\"", "array of 1000000 f32 elements",
                                "needs at least 4000000 bytes, 16 left"});
}

TEST(GgufReader, RefusesAnArrayLongerThanTheGgufMaximum) {
  GgufBytes bytes;
  bytes.header(3, 0, 1).str("a").i32(9).i32(0).u64((1ull << 30) + 1);
  expect_refused(bytes.span(), {"key \"a\"", "exceeds the GGUF maximum"});
}

TEST(GgufReader, RefusesAStringLengthPastTheEndOfTheFile) {
  GgufBytes bytes;
  bytes.header(3, 0, 1).str("general.name").i32(8).u64(100).zeros(5);
  expect_refused(bytes.span(),
                 {"key \"general.name\"", "length 100 runs past the end of the file (5 bytes left)", "byte offset 48"});
}

TEST(GgufReader, RefusesAKeyLengthPastTheEndOfTheFile) {
  GgufBytes bytes;
  bytes.header(3, 0, 1).u64(1ull << 40).zeros(8);
  expect_refused(bytes.span(), {"key #0", "exceeds the GGUF maximum", "byte offset 24"});
}

TEST(GgufReader, RefusesAnArrayOfArrays) {
  GgufBytes bytes;
  bytes.header(3, 0, 1).str("nested").i32(9).i32(9).u64(1).i32(0).u64(0);
  expect_refused(bytes.span(), {"key \"nested\"", "arrays of arrays", "byte offset 42"});
}

TEST(GgufReader, RefusesAnUnknownValueTypeId) {
  GgufBytes bytes;
  bytes.header(3, 0, 1).str("k").i32(13).u32(0);
  expect_refused(bytes.span(), {"key \"k\"", "invalid GGUF value type id 13", "byte offset 33"});
}

TEST(GgufReader, RefusesANegativeArrayElementTypeId) {
  GgufBytes bytes;
  bytes.header(3, 0, 1).str("k").i32(9).i32(-1).u64(0);
  expect_refused(bytes.span(), {"key \"k\"", "invalid GGUF value type id -1", "array element type"});
}

TEST(GgufReader, RefusesADuplicateKey) {
  GgufBytes bytes;
  bytes.header(3, 0, 2).kv_u32("llama.block_count", 1).kv_u32("llama.block_count", 2);
  expect_refused(bytes.span(), {"key \"llama.block_count\"", "duplicate key", "byte offset 57"});
}

TEST(GgufReader, RefusesAnEmptyKey) {
  GgufBytes bytes;
  bytes.header(3, 0, 1).kv_u32("", 1);
  expect_refused(bytes.span(), {"key #0", "key is empty"});
}

TEST(GgufReader, RefusesAGeneralAlignmentThatIsNotU32AsGgmlDoes) {
  // ggml reads it with gguf_get_val_u32, whose type assertion aborts the process.
  GgufBytes bytes;
  bytes.header(3, 0, 1).str("general.alignment").i32(5).i32(64);
  expect_refused(bytes.span(), {"key \"general.alignment\"", "has type i32, must be u32", "byte offset 24"});
}

TEST(GgufReader, RefusesAnAlignmentThatIsNotAPowerOfTwo) {
  GgufBytes bytes;
  bytes.header(3, 0, 1).kv_u32("general.alignment", 48);
  expect_refused(bytes.span(), {"key \"general.alignment\"", "alignment 48 is not a power of 2"});
}

TEST(GgufReader, RefusesAZeroAlignment) {
  GgufBytes bytes;
  bytes.header(3, 0, 1).kv_u32("general.alignment", 0);
  expect_refused(bytes.span(), {"alignment 0 is not a power of 2"});
}

TEST(GgufReader, UsesACustomAlignmentForTheDataSection) {
  GgufBytes bytes;
  bytes.header(3, 1, 1).kv_u32("general.alignment", 128).tensor("w", {1}, kF32, 0).pad_to(128);
  auto file = parse_gguf(bytes.span(), "aligned.gguf");
  ASSERT_TRUE(file) << file.error().what();
  EXPECT_EQ(file->alignment, 128u);
  EXPECT_EQ(file->data_offset, 128u);
  EXPECT_EQ(file->data_size, 128u);
}

TEST(GgufReader, RefusesADuplicateTensorName) {
  GgufBytes bytes;
  bytes.header(3, 2, 0).tensor("w", {32}, kF32, 0).tensor("w", {32}, kF32, 128).pad_to(32);
  expect_refused(bytes.span(), {"tensor \"w\"", "duplicate tensor name", "byte offset 57"});
}

TEST(GgufReader, RefusesATensorNameOf64Bytes) {
  GgufBytes bytes;
  bytes.header(3, 1, 0).tensor(std::string(64, 'n'), {1}, kF32, 0).pad_to(32);
  expect_refused(bytes.span(), {"name is 64 bytes, longer than ggml's limit of 63", "byte offset 24"});
}

TEST(GgufReader, RefusesMoreThanFourDimensions) {
  GgufBytes bytes;
  bytes.header(3, 1, 0).tensor("w", {1, 1, 1, 1, 1}, kF32, 0).pad_to(32);
  expect_refused(bytes.span(), {"tensor \"w\"", "n_dims is 5, at most 4", "byte offset 33"});
}

TEST(GgufReader, RefusesANegativeDimension) {
  GgufBytes bytes;
  bytes.header(3, 1, 0).tensor("w", {4, -2}, kF32, 0).pad_to(32);
  expect_refused(bytes.span(), {"tensor \"w\"", "ne[1] is -2", "byte offset 45"});
}

TEST(GgufReader, RefusesAnElementCountThatOverflows) {
  GgufBytes bytes;
  bytes.header(3, 1, 0).tensor("w", {int64_t{1} << 40, int64_t{1} << 40}, kF32, 0).pad_to(32);
  expect_refused(bytes.span(), {"tensor \"w\"", "more than INT64_MAX elements"});
}

TEST(GgufReader, RefusesAByteSizeThatOverflows) {
  GgufBytes bytes;
  bytes.header(3, 1, 0).tensor("w", {int64_t{1} << 31, int64_t{1} << 31}, kF32, 0).pad_to(32);
  expect_refused(bytes.span(), {"tensor \"w\"", "more than 2^64 bytes"});
}

TEST(GgufReader, AcceptsAZeroDimensionThatWouldMakeGgmlDivideByZero) {
  // ggml's element-count check divides INT64_MAX by ne[1..3]; a zero there is SIGFPE.
  GgufBytes bytes;
  bytes.header(3, 1, 0).tensor("w", {4, 0}, kF32, 0).pad_to(32);
  auto file = parse_gguf(bytes.span(), "zero.gguf");
  ASSERT_TRUE(file) << file.error().what();
  EXPECT_EQ(file->tensors[0].size_bytes, 0u);
}

TEST(GgufReader, RefusesAnUnknownGgmlTypeId) {
  GgufBytes bytes;
  bytes.header(3, 1, 0).tensor("w", {32}, 4, 0).pad_to(32);  // 4 was Q4_2, removed
  expect_refused(bytes.span(), {"tensor \"w\"", "invalid ggml type id 4", "byte offset 45"});
}

TEST(GgufReader, RefusesARowThatIsNotAMultipleOfTheBlockSize) {
  GgufBytes bytes;
  bytes.header(3, 1, 0).tensor("blk.0.attn_q.weight", {33, 2}, kQ8_0, 0).pad_to(32);
  expect_refused(bytes.span(), {"tensor \"blk.0.attn_q.weight\"",
                                "type q8_0 has 33 elements per row, not a multiple of its block size 32"});
}

TEST(GgufReader, RefusesAnOffsetThatIsNotTheRunningPaddedSum) {
  GgufBytes bytes;
  // "a" takes 12 bytes, padded to 32: "b" must start at 32, not 12.
  bytes.header(3, 2, 0).tensor("a", {3}, kF32, 0).tensor("b", {3}, kF32, 12).pad_to(32).zeros(64);
  expect_refused(bytes.span(), {"tensor \"b\"", "data offset is 12, expected 32", "byte offset 82"});
}

TEST(GgufReader, RefusesAFirstOffsetThatIsNotZero) {
  GgufBytes bytes;
  bytes.header(3, 1, 0).tensor("a", {8}, kF32, 32).pad_to(32).zeros(64);
  expect_refused(bytes.span(), {"tensor \"a\"", "data offset is 32, expected 0"});
}

TEST(GgufReader, RefusesAFileThatEndsInsideThePaddingBeforeTheData) {
  GgufBytes bytes;
  bytes.header(3, 1, 0).tensor("a", {8}, kF32, 0);  // 57 bytes: the padding to 64 is missing
  expect_refused(bytes.span(), {"padding before the data section", "starts at 64"});
}

TEST(GgufReader, RefusesAShapeWhoseDataSectionSizeOverflows) {
  GgufBytes bytes;
  const int64_t big = int64_t{1} << 61;  // each f32 tensor takes 2^63 bytes; two overflow
  bytes.header(3, 3, 0).tensor("a", {big}, kF32, 0).tensor("b", {big}, kF32, uint64_t{1} << 63);
  bytes.tensor("c", {1}, kF32, 0).pad_to(32);
  expect_refused(bytes.span(), {"tensor \"b\"", "overflows 64 bits"});
}

TEST(GgufReader, TakesAnyNonZeroBoolByteAsTrueAsGgmlDoes) {
  GgufBytes bytes;
  bytes.header(3, 0, 1).str("b").i32(7).u8(2);
  auto file = parse_gguf(bytes.span(), "bool.gguf");
  ASSERT_TRUE(file);
  EXPECT_TRUE(file->metadata.get_bool("b").value());
}

TEST(GgufReader, RefusesAnEmptyImage) { expect_refused({}, {"header", "the magic", "byte offset 0"}); }

TEST(TensorData, RefusesATensorInfoWhoseRangeOverflows) {
  GgufFile file;
  file.name = "x.gguf";
  file.data_offset = 64;
  GgufTensorInfo tensor;
  tensor.name = "w";
  tensor.offset = std::numeric_limits<uint64_t>::max() - 10;
  tensor.size_bytes = 4;
  auto data = tensor_data(file, tensor);
  ASSERT_FALSE(data);
  EXPECT_EQ(data.error().errno_value(), EINVAL);
  EXPECT_NE(data.error().message().find("overflows"), std::string::npos);
}

}  // namespace
}  // namespace kvshare::layout
