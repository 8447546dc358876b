// kvshare::scatter against positions computed here from llama.cpp's tensor geometry and
// values converted one element at a time with layout/half.h.
#include "kvshare/scatter/scatter.h"

#include <gtest/gtest.h>

#include <cstring>

#include "layout/half.h"
#include "layout/row_convert.h"
#include "support/cache_fixture.h"

namespace kvshare {
namespace {

using layout::GgmlType;
using testing::CacheSpec;
using testing::make_rows;
using testing::Region;

uint16_t half_at(const std::byte* base, uint64_t element) {
  uint16_t h;
  std::memcpy(&h, base + element * 2, 2);
  return h;
}

ScatterBatch one_layer_batch(uint32_t il, const testing::ProviderRows& rows, uint32_t n_k, uint32_t n_v,
                             GgmlType src_type, uint32_t pos0, uint32_t n_tokens) {
  ScatterBatch batch;
  batch.layers.push_back({il, rows.bytes.data(), n_k, n_v});
  batch.pos0 = pos0;
  batch.n_tokens = n_tokens;
  batch.src_type = src_type;
  batch.row_stride = rows.row_stride;
  return batch;
}

TEST(Scatter, WritesEachTokensKAndVRowsAtItsCellWithFlashAttention) {
  CacheSpec spec{{64, 64}, {64, 64}, 32};
  Region region(spec);
  const auto rows = make_rows(5, 64, 64, GgmlType::F32, 1, 12);
  ASSERT_TRUE(scatter(region.target(), one_layer_batch(1, rows, 64, 64, GgmlType::F32, 7, 5)));
  const std::byte* k = region.tensor("cache_k_l1");
  const std::byte* v = region.tensor("cache_v_l1");
  for (uint32_t t = 0; t < 5; ++t)
    for (uint32_t j = 0; j < 64; ++j) {
      ASSERT_EQ(half_at(k, (7 + t) * 64 + j), layout::fp32_to_fp16(rows.f32[t * 128 + j])) << t << " " << j;
      ASSERT_EQ(half_at(v, (7 + t) * 64 + j), layout::fp32_to_fp16(rows.f32[t * 128 + 64 + j])) << t << " " << j;
    }
}

TEST(Scatter, LeavesOtherCellsAndLayersUntouched) {
  CacheSpec spec{{32, 32}, {32, 32}, 16};
  Region region(spec);
  const auto rows = make_rows(3, 32, 32, GgmlType::F16, 2);
  ASSERT_TRUE(scatter(region.target(), one_layer_batch(0, rows, 32, 32, GgmlType::F16, 4, 3)));
  const std::byte* k0 = region.tensor("cache_k_l0");
  for (uint64_t b = 0; b < 4 * 64; ++b) ASSERT_EQ(k0[b], std::byte{0xAB}) << b;        // cells 0..3
  for (uint64_t b = 7 * 64; b < 16 * 64; ++b) ASSERT_EQ(k0[b], std::byte{0xAB}) << b;  // cells 7..15
  const std::byte* k1 = region.tensor("cache_k_l1");
  for (uint64_t b = 0; b < 16 * 64; ++b) ASSERT_EQ(k1[b], std::byte{0xAB}) << b;
  // f16 -> f16 is a byte copy of the K part of each row.
  EXPECT_EQ(std::memcmp(k0 + 4 * 64, rows.bytes.data(), 64), 0);
}

TEST(Scatter, WritesTransposedVOneElementPerCellRowAndZeroPadsANarrowerLayer) {
  // Layer 0 has V width 32, layer 1 has 64: with v_trans both tensors are 64 wide and the
  // rows 32..63 of layer 0 get zeros (llama.cpp's ggml_pad in cpy_v).
  CacheSpec spec{{32, 64}, {32, 64}, 16, 1, GgmlType::F16, GgmlType::F16, true};
  Region region(spec);
  const auto rows = make_rows(4, 32, 32, GgmlType::F32, 3);
  ASSERT_TRUE(scatter(region.target(), one_layer_batch(0, rows, 32, 32, GgmlType::F32, 9, 4)));
  const std::byte* v = region.tensor("cache_v_l0");
  for (uint32_t t = 0; t < 4; ++t) {
    for (uint32_t j = 0; j < 32; ++j)
      ASSERT_EQ(half_at(v, (9 + t) + j * 16), layout::fp32_to_fp16(rows.f32[t * 64 + 32 + j])) << t << " " << j;
    for (uint32_t j = 32; j < 64; ++j) ASSERT_EQ(half_at(v, (9 + t) + j * 16), 0) << t << " " << j;
  }
  EXPECT_EQ(half_at(v, 8), 0xABAB);  // cell 8 of element row 0: untouched
}

TEST(Scatter, WritesTheRequestedStream) {
  CacheSpec spec{{32}, {32}, 8, 2};
  Region region(spec);
  const auto rows = make_rows(2, 32, 32, GgmlType::F16, 4);
  ScatterBatch batch = one_layer_batch(0, rows, 32, 32, GgmlType::F16, 1, 2);
  batch.stream = 1;
  ASSERT_TRUE(scatter(region.target(), batch));
  const std::byte* k = region.tensor("cache_k_l0");
  EXPECT_EQ(std::memcmp(k + (8 + 1) * 64, rows.bytes.data(), 64), 0);
  EXPECT_EQ(k[64], std::byte{0xAB});  // stream 0 cell 1
}

TEST(Scatter, QuantizesQ8_0CachesAfterTheRotationLlamaCppApplies) {
  CacheSpec spec{{256}, {256}, 8, 1, GgmlType::Q8_0, GgmlType::Q8_0};
  Region region(spec);
  const auto rows = make_rows(3, 256, 256, GgmlType::F32, 5);
  ASSERT_TRUE(scatter(region.target(128, 128), one_layer_batch(0, rows, 256, 256, GgmlType::F32, 2, 3)));
  const uint64_t row_bytes = layout::ggml_row_size(GgmlType::Q8_0, 256);
  for (uint32_t t = 0; t < 3; ++t) {
    // K rotates by the head size (128), V always by 64.
    std::vector<float> k(rows.f32.begin() + t * 512, rows.f32.begin() + t * 512 + 256);
    std::vector<float> v(rows.f32.begin() + t * 512 + 256, rows.f32.begin() + t * 512 + 512);
    layout::hadamard_rotate(k.data(), 256, 128);
    layout::hadamard_rotate(v.data(), 256, 64);
    std::vector<std::byte> expected_k(row_bytes), expected_v(row_bytes);
    layout::convert_row(GgmlType::F32, k.data(), GgmlType::Q8_0, expected_k.data(), 256);
    layout::convert_row(GgmlType::F32, v.data(), GgmlType::Q8_0, expected_v.data(), 256);
    EXPECT_EQ(std::memcmp(region.tensor("cache_k_l0") + (2 + t) * row_bytes, expected_k.data(), row_bytes), 0) << t;
    EXPECT_EQ(std::memcmp(region.tensor("cache_v_l0") + (2 + t) * row_bytes, expected_v.data(), row_bytes), 0) << t;
  }
}

TEST(Scatter, SkipsTheRotationWhenTheDecoderDisablesIt) {
  CacheSpec spec{{64}, {64}, 4, 1, GgmlType::Q8_0, GgmlType::F16};
  Region region(spec);
  const auto rows = make_rows(1, 64, 64, GgmlType::F32, 6);
  ScatterBatch batch = one_layer_batch(0, rows, 64, 64, GgmlType::F32, 0, 1);
  batch.rotation_disabled = true;
  ASSERT_TRUE(scatter(region.target(), batch));
  std::vector<std::byte> expected(layout::ggml_row_size(GgmlType::Q8_0, 64));
  layout::convert_row(GgmlType::F32, rows.f32.data(), GgmlType::Q8_0, expected.data(), 64);
  EXPECT_EQ(std::memcmp(region.tensor("cache_k_l0"), expected.data(), expected.size()), 0);
}

TEST(Scatter, GivesTheSameBytesOnOneThreadAndOnMany) {
  CacheSpec spec{{128, 128, 128}, {128, 128, 128}, 1024, 1, GgmlType::F16, GgmlType::F16, true};
  Region one(spec), many(spec);
  std::vector<testing::ProviderRows> rows;
  ScatterBatch batch;
  for (uint32_t il = 0; il < 3; ++il) rows.push_back(make_rows(700, 128, 128, GgmlType::BF16, 10 + il));
  for (uint32_t il = 0; il < 3; ++il) batch.layers.push_back({il, rows[il].bytes.data(), 128, 128});
  batch.pos0 = 300;
  batch.n_tokens = 700;
  batch.src_type = GgmlType::BF16;
  batch.row_stride = rows[0].row_stride;
  batch.n_threads = 1;
  ASSERT_TRUE(scatter(one.target(), batch));
  batch.n_threads = 4;
  ASSERT_TRUE(scatter(many.target(), batch));
  EXPECT_EQ(one.storage, many.storage);
}

TEST(Scatter, RefusesPositionsPastKvSizeNamingLayerTensorAndPosition) {
  CacheSpec spec{{32}, {32}, 16};
  Region region(spec);
  const auto rows = make_rows(4, 32, 32, GgmlType::F32, 7);
  auto result = scatter(region.target(), one_layer_batch(0, rows, 32, 32, GgmlType::F32, 14, 4));
  ASSERT_FALSE(result);
  EXPECT_EQ(result.error().errno_value(), EINVAL);
  EXPECT_NE(result.error().message().find("layer 0 cache_k_l0: positions 14..17 pass kv_size 16"), std::string::npos)
      << result.error().message();
  for (const auto& chunk : region.storage)
    for (std::byte b : chunk) ASSERT_EQ(b, std::byte{0xAB});
}

TEST(Scatter, RefusesRowsWhoseKWidthDiffersFromTheCache) {
  CacheSpec spec{{64}, {64}, 8};
  Region region(spec);
  const auto rows = make_rows(1, 32, 64, GgmlType::F32, 8);
  auto result = scatter(region.target(), one_layer_batch(0, rows, 32, 64, GgmlType::F32, 0, 1));
  ASSERT_FALSE(result);
  EXPECT_NE(result.error().message().find("cache_k_l0: the provider's rows carry 32 K values, the cache holds 64"),
            std::string::npos)
      << result.error().message();
}

TEST(Scatter, RefusesALayerTheLayoutDoesNotHave) {
  CacheSpec spec{{32}, {32}, 8};
  Region region(spec);
  const auto rows = make_rows(1, 32, 32, GgmlType::F32, 9);
  auto result = scatter(region.target(), one_layer_batch(3, rows, 32, 32, GgmlType::F32, 0, 1));
  ASSERT_FALSE(result);
  EXPECT_NE(result.error().message().find("no cache_k_l3"), std::string::npos) << result.error().message();
}

TEST(Scatter, RefusesAChunkMappingShorterThanTheLayout) {
  CacheSpec spec{{32}, {32}, 8};
  Region region(spec);
  ScatterTarget target = region.target();
  target.chunks[0] = target.chunks[0].first(100);
  const auto rows = make_rows(1, 32, 32, GgmlType::F32, 10);
  auto result = scatter(target, one_layer_batch(0, rows, 32, 32, GgmlType::F32, 0, 1));
  ASSERT_FALSE(result);
  EXPECT_NE(result.error().message().find("whose mapping has 100 bytes"), std::string::npos)
      << result.error().message();
}

TEST(Scatter, RefusesAQuantizedCacheWithoutTheHeadSizeItsRotationNeeds) {
  CacheSpec spec{{64}, {64}, 8, 1, GgmlType::Q8_0, GgmlType::F16};
  Region region(spec);
  const auto rows = make_rows(1, 64, 64, GgmlType::F32, 11);
  auto result = scatter(region.target(), one_layer_batch(0, rows, 64, 64, GgmlType::F32, 0, 1));
  ASSERT_FALSE(result);
  EXPECT_NE(result.error().message().find("n_embd_head_k is 0"), std::string::npos) << result.error().message();
}

TEST(Scatter, RefusesARowStrideShorterThanARow) {
  CacheSpec spec{{32}, {32}, 8};
  Region region(spec);
  const auto rows = make_rows(2, 32, 32, GgmlType::F32, 12);
  ScatterBatch batch = one_layer_batch(0, rows, 32, 32, GgmlType::F32, 0, 2);
  batch.row_stride = 128;
  auto result = scatter(region.target(), batch);
  ASSERT_FALSE(result);
  EXPECT_NE(result.error().message().find("row stride 128 bytes is shorter"), std::string::npos)
      << result.error().message();
}

TEST(Scatter, RefusesAQuantizedSourceType) {
  CacheSpec spec{{32}, {32}, 8};
  Region region(spec);
  const auto rows = make_rows(1, 32, 32, GgmlType::F32, 13);
  auto result = scatter(region.target(), one_layer_batch(0, rows, 32, 32, GgmlType::Q8_0, 0, 1));
  ASSERT_FALSE(result);
  EXPECT_NE(result.error().message().find("source rows are q8_0"), std::string::npos) << result.error().message();
}

TEST(Gather, ReadsBackWhatScatterWroteAsF32Rows) {
  CacheSpec spec{{64, 64}, {64, 64}, 16, 1, GgmlType::F32, GgmlType::F16, true};
  Region region(spec);
  auto rows = make_rows(6, 64, 64, GgmlType::F32, 14);
  ASSERT_TRUE(scatter(region.target(), one_layer_batch(1, rows, 64, 64, GgmlType::F32, 3, 6)));
  std::vector<float> back(6 * 128);
  ASSERT_TRUE(gather(region.target(), GatherRequest{1, 3, 6}, back));
  for (uint32_t t = 0; t < 6; ++t)
    for (uint32_t j = 0; j < 128; ++j) {
      const float source = rows.f32[t * 128 + j];
      const float expected = j < 64 ? source : layout::fp16_to_fp32(layout::fp32_to_fp16(source));
      ASSERT_EQ(back[t * 128 + j], expected) << t << " " << j;
    }
}

TEST(Gather, UndoesTheRotationOfAQuantizedCacheWhenAsked) {
  CacheSpec spec{{128}, {128}, 4, 1, GgmlType::Q8_0, GgmlType::Q8_0};
  Region region(spec);
  auto rows = make_rows(2, 128, 128, GgmlType::F32, 15);
  ASSERT_TRUE(scatter(region.target(128, 128), one_layer_batch(0, rows, 128, 128, GgmlType::F32, 0, 2)));
  std::vector<float> back(2 * 256);
  GatherRequest request{0, 0, 2};
  request.undo_rotation = true;
  ASSERT_TRUE(gather(region.target(128, 128), request, back));
  for (size_t i = 0; i < back.size(); ++i) EXPECT_NEAR(back[i], rows.f32[i], 0.1f) << i;
}

}  // namespace
}  // namespace kvshare
