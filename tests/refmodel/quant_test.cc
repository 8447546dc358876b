// Weight dequantization against ggml's own output. The input blocks are built by the
// construction in docs/refmodel.md ("Dequantization vectors"); tests/data/
// refmodel-dequant-<type>.txt holds what ggml's type_traits[type].to_float (libggml-base
// at llama.cpp d32676d) returns for them, one %a float per line.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <string>

#include "layout/half.h"
#include "layout/tensor_type.h"
#include "refmodel/quant.h"
#include "support/test_support.h"

namespace kvshare::refmodel {
namespace {

using layout::GgmlType;

std::vector<uint8_t> construct(GgmlType type, int64_t n) {
  const auto traits = layout::ggml_traits(type);
  const uint64_t bytes = layout::ggml_row_size(type, n);
  std::vector<uint8_t> buf(bytes);
  for (size_t i = 0; i < bytes; ++i) buf[i] = static_cast<uint8_t>((i * 73 + 41) & 0xFF);
  auto put16 = [](uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); };
  for (uint64_t b = 0; b < bytes / static_cast<uint64_t>(traits.type_size); ++b) {
    uint8_t* blk = buf.data() + b * traits.type_size;
    const uint16_t d = layout::fp32_to_fp16(0.25f + 0.125f * static_cast<float>(b));
    const uint16_t dmin = layout::fp32_to_fp16(0.0625f * static_cast<float>(b + 1));
    switch (type) {
      case GgmlType::Q8_0:
      case GgmlType::Q4_0:
        put16(blk, d);
        break;
      case GgmlType::Q4_K:
        put16(blk, d);
        put16(blk + 2, dmin);
        break;
      case GgmlType::Q6_K:
        put16(blk + 208, d);
        break;
      case GgmlType::F16:
        put16(blk, static_cast<uint16_t>(0x3000 + ((b * 97) % 0x1000) + ((b & 1) << 15)));
        break;
      case GgmlType::BF16:
        put16(blk, static_cast<uint16_t>(0x3F00 + ((b * 13) % 0x100) + ((b & 1) << 15)));
        break;
      default:
        break;
    }
  }
  return buf;
}

std::vector<float> ggml_reference(const std::string& type_name) {
  std::ifstream in(kvshare::testing::data_path("refmodel-dequant-" + type_name + ".txt"));
  std::vector<float> values;
  std::string line;
  while (std::getline(in, line))
    if (!line.empty() && line[0] != '#') values.push_back(std::strtof(line.c_str(), nullptr));
  return values;
}

void expect_bit_exact(GgmlType type) {
  const std::string name(layout::ggml_type_name(type));
  const auto expected = ggml_reference(name);
  ASSERT_FALSE(expected.empty()) << "missing vector for " << name;
  const auto input = construct(type, static_cast<int64_t>(expected.size()));
  std::vector<float> got(expected.size());
  auto ok = dequantize_weights(type, input.data(), got.data(), static_cast<int64_t>(got.size()));
  ASSERT_TRUE(ok) << ok.error().what();
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(expected[i]))
        << name << " element " << i << ": " << got[i] << " vs ggml " << expected[i];
}

TEST(DequantizeWeights, F16MatchesGgmlBitForBit) { expect_bit_exact(GgmlType::F16); }
TEST(DequantizeWeights, Bf16MatchesGgmlBitForBit) { expect_bit_exact(GgmlType::BF16); }
TEST(DequantizeWeights, Q8_0MatchesGgmlBitForBit) { expect_bit_exact(GgmlType::Q8_0); }
TEST(DequantizeWeights, Q4_0MatchesGgmlBitForBit) { expect_bit_exact(GgmlType::Q4_0); }
TEST(DequantizeWeights, Q4_KMatchesGgmlBitForBit) { expect_bit_exact(GgmlType::Q4_K); }
TEST(DequantizeWeights, Q6_KMatchesGgmlBitForBit) { expect_bit_exact(GgmlType::Q6_K); }

TEST(DequantizeWeights, RefusesATypeItDoesNotDecodeNamingIt) {
  std::vector<uint8_t> block(64);
  std::vector<float> out(32);
  auto ok = dequantize_weights(GgmlType::Q5_1, block.data(), out.data(), 32);
  ASSERT_FALSE(ok);
  EXPECT_NE(ok.error().message().find("q5_1"), std::string::npos) << ok.error().message();
}

TEST(CacheRotation, FollowsLlamaCppsGroupRule) {
  EXPECT_EQ(cache_rotation_group(true, GgmlType::F16, 128), 0);
  EXPECT_EQ(cache_rotation_group(true, GgmlType::Q8_0, 64), 64);
  EXPECT_EQ(cache_rotation_group(true, GgmlType::Q8_0, 128), 128);
  EXPECT_EQ(cache_rotation_group(true, GgmlType::Q8_0, 192), 64);
  EXPECT_EQ(cache_rotation_group(false, GgmlType::Q8_0, 128), 64);
  EXPECT_EQ(cache_rotation_group(true, GgmlType::Q8_0, 80), 0);
  EXPECT_EQ(cache_rotation_group(true, GgmlType::Q8_0, 128, /*rotation_disabled=*/true), 0);
}

TEST(CacheRotation, HadamardIsOrthonormalAndItsOwnInverse) {
  std::vector<float> v(128);
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::sin(static_cast<float>(i) * 0.7f);
  const auto original = v;
  hadamard_groups(v.data(), 128, 64);
  double n0 = 0, n1 = 0;
  for (size_t i = 0; i < 64; ++i) {
    n0 += original[i] * original[i];
    n1 += v[i] * v[i];
  }
  EXPECT_NEAR(n0, n1, 1e-4);
  // Sylvester order: row 1 of H_64 alternates +1, -1.
  double row1 = 0;
  for (size_t i = 0; i < 64; ++i) row1 += (i % 2 ? -1.0 : 1.0) * original[i] / 8.0;
  EXPECT_NEAR(v[1], row1, 1e-5);
  hadamard_groups(v.data(), 128, 64);
  for (size_t i = 0; i < v.size(); ++i) EXPECT_NEAR(v[i], original[i], 1e-5);
}

}  // namespace
}  // namespace kvshare::refmodel
