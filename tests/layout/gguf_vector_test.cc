// tests/data/gguf-tiny.gguf was written by ggml itself (gguf_write_to_file of llama.cpp
// d32676d, q8_0 data from ggml_quantize_chunk), so our reader and writer are checked
// against ggml's writer, not against each other. docs/gguf.md walks it byte by byte.
#include <gtest/gtest.h>

#include <cstring>

#include "layout/gguf_reader.h"
#include "layout/gguf_writer.h"
#include "support/test_support.h"

namespace kvshare::layout {
namespace {

std::vector<std::byte> tiny_vector() {
  return kvshare::testing::read_file_bytes(kvshare::testing::data_path("gguf-tiny.gguf"));
}

// The values mk_tiny gave ggml (docs/gguf.md, "Worked example").
std::vector<float> f32_values() {
  std::vector<float> values(8);
  for (int i = 0; i < 8; ++i) values[i] = 0.5f * static_cast<float>(i - 3);
  return values;
}
std::vector<float> q8_0_source_values() {
  std::vector<float> values(32);
  for (int i = 0; i < 32; ++i) values[i] = static_cast<float>(i - 16) * 0.125f;
  return values;
}

TEST(GgufTinyVector, DecodesFieldByField) {
  const std::vector<std::byte> bytes = tiny_vector();
  ASSERT_EQ(bytes.size(), 480u);
  auto file = parse_gguf(bytes, "gguf-tiny.gguf");
  ASSERT_TRUE(file) << file.error().what();

  EXPECT_EQ(file->version, 3u);
  EXPECT_EQ(file->alignment, 32u);
  EXPECT_EQ(file->data_offset, 384u);
  EXPECT_EQ(file->data_size, 96u);

  const auto& entries = file->metadata.entries();
  ASSERT_EQ(entries.size(), 6u);
  EXPECT_EQ(entries[0].first, "general.architecture");
  EXPECT_EQ(file->metadata.get_string("general.architecture").value(), "llama");
  EXPECT_EQ(entries[1].first, "llama.block_count");
  EXPECT_EQ(file->metadata.get_u32("llama.block_count").value(), 1u);
  EXPECT_EQ(entries[2].first, "llama.rope.freq_base");
  EXPECT_EQ(file->metadata.get_f32("llama.rope.freq_base").value(), 10000.0f);
  EXPECT_EQ(entries[3].first, "tiny.is_example");
  EXPECT_TRUE(file->metadata.get_bool("tiny.is_example").value());
  EXPECT_EQ(entries[4].first, "llama.attention.head_count_kv");
  const GgufArray* head_count_kv = file->metadata.get_array("llama.attention.head_count_kv").value();
  EXPECT_EQ(head_count_kv->element_type, GgufValueType::INT32);
  ASSERT_EQ(head_count_kv->elements.size(), 1u);
  EXPECT_EQ(*head_count_kv->elements[0].get_if<int32_t>(), 2);
  EXPECT_EQ(entries[5].first, "tokenizer.ggml.tokens");
  const GgufArray* tokens = file->metadata.get_array("tokenizer.ggml.tokens").value();
  EXPECT_EQ(tokens->element_type, GgufValueType::STRING);
  ASSERT_EQ(tokens->elements.size(), 3u);
  EXPECT_EQ(*tokens->elements[0].get_if<std::string>(), "<s>");
  EXPECT_EQ(*tokens->elements[2].get_if<std::string>(), "b");

  ASSERT_EQ(file->tensors.size(), 2u);
  const GgufTensorInfo& w_f32 = file->tensors[0];
  EXPECT_EQ(w_f32.name, "w.f32");
  EXPECT_EQ(w_f32.n_dims, 2u);
  EXPECT_EQ(w_f32.ne, (std::array<int64_t, 4>{4, 2, 1, 1}));
  EXPECT_EQ(w_f32.type, GgmlType::F32);
  EXPECT_EQ(w_f32.offset, 0u);
  EXPECT_EQ(w_f32.size_bytes, 32u);
  const GgufTensorInfo& w_q8 = file->tensors[1];
  EXPECT_EQ(w_q8.name, "w.q8_0");
  EXPECT_EQ(w_q8.n_dims, 1u);
  EXPECT_EQ(w_q8.ne, (std::array<int64_t, 4>{32, 1, 1, 1}));
  EXPECT_EQ(w_q8.type, GgmlType::Q8_0);
  EXPECT_EQ(w_q8.offset, 32u);
  EXPECT_EQ(w_q8.size_bytes, 34u);

  auto f32_data = tensor_data(*file, w_f32).value();
  EXPECT_EQ(f32_data.data(), bytes.data() + 384);
  const std::vector<float> expected = f32_values();
  EXPECT_EQ(std::memcmp(f32_data.data(), expected.data(), 32), 0);
  auto q8_data = tensor_data(*file, w_q8).value();
  EXPECT_EQ(q8_data.data(), bytes.data() + 416);
  uint16_t d_bits = 0;
  std::memcpy(&d_bits, q8_data.data(), 2);
  EXPECT_EQ(d_bits, 0x2408);  // f16 of 2/127, the block's amax over 127
  EXPECT_EQ(static_cast<int8_t>(q8_data[2]), -127);
  EXPECT_EQ(static_cast<int8_t>(q8_data[2 + 16]), 0);
}

TEST(GgufTinyVector, ReencodesToTheSameBytes) {
  const std::vector<std::byte> bytes = tiny_vector();
  auto file = parse_gguf(bytes, "gguf-tiny.gguf");
  ASSERT_TRUE(file) << file.error().what();
  auto writer = GgufWriter::from_file(*file);
  ASSERT_TRUE(writer) << writer.error().what();
  auto again = writer->finish();
  ASSERT_TRUE(again) << again.error().what();
  EXPECT_EQ(*again, bytes);
}

TEST(GgufTinyVector, IsWhatOurWriterProducesFromTheSameInputsAsGgml) {
  GgufWriter writer;
  writer.add_string("general.architecture", "llama");
  writer.add_u32("llama.block_count", 1);
  writer.add_f32("llama.rope.freq_base", 10000.0f);
  writer.add_bool("tiny.is_example", true);
  writer.add_i32_array("llama.attention.head_count_kv", {2});
  writer.add_string_array("tokenizer.ggml.tokens", {"<s>", "a", "b"});
  ASSERT_TRUE(writer.add_tensor_from_f32("w.f32", GgmlType::F32, {4, 2}, f32_values()));
  // Our q8_0 quantizer against ggml_quantize_chunk's bytes in the vector.
  ASSERT_TRUE(writer.add_tensor_from_f32("w.q8_0", GgmlType::Q8_0, {32}, q8_0_source_values()));
  auto bytes = writer.finish();
  ASSERT_TRUE(bytes) << bytes.error().what();
  EXPECT_EQ(*bytes, tiny_vector());
}

TEST(GgufTinyVector, KeepsItsMetadataAsAShapeOnlyFileEndingAtTheDataOffset) {
  const std::vector<std::byte> bytes = tiny_vector();
  auto file = parse_gguf(std::span(bytes).first(384), "gguf-tiny-shape.gguf");
  ASSERT_TRUE(file) << file.error().what();
  EXPECT_FALSE(file->has_tensor_data());
  auto writer = GgufWriter::from_file(*file);
  ASSERT_TRUE(writer);
  auto meta = writer->finish(GgufPayload::kMetaOnly);
  ASSERT_TRUE(meta);
  EXPECT_TRUE(std::equal(meta->begin(), meta->end(), bytes.begin(), bytes.begin() + 384));
  EXPECT_EQ(meta->size(), 384u);
}

}  // namespace
}  // namespace kvshare::layout
