// Row conversion: expected bytes are computed by hand from the IEEE and ggml block
// definitions (not by running our own code twice), and every vector kernel is compared
// with its scalar twin on inputs that stress rounding.
#include "layout/row_convert.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "layout/half.h"
#include "layout/q_types.h"
#include "layout/row_convert_kernels.h"

namespace kvshare::layout {
namespace {

using blocks::BlockQ4_0;
using blocks::BlockQ4_K;
using blocks::BlockQ6_K;
using blocks::BlockQ8_0;

float bits_to_float(uint32_t bits) { return std::bit_cast<float>(bits); }

// Values that sit on every rounding edge of f16 and q8_0, plus random ones.
std::vector<float> awkward_floats(size_t random_count, uint32_t seed) {
  std::vector<float> values = {
      0.0f,
      -0.0f,
      1.0f,
      -1.0f,
      65504.0f,
      65520.0f,
      -65520.0f,
      65519.99f,
      1e30f,
      -1e30f,
      std::numeric_limits<float>::infinity(),
      -std::numeric_limits<float>::infinity(),
      std::numeric_limits<float>::quiet_NaN(),
      -std::numeric_limits<float>::quiet_NaN(),
      bits_to_float(0x7F800001u),
      bits_to_float(0xFFFFFFFFu),
      bits_to_float(0x7FC12345u),
      std::numeric_limits<float>::denorm_min(),
      -std::numeric_limits<float>::denorm_min(),
      std::numeric_limits<float>::min(),
      0x1.0p-24f,
      0x1.0p-25f,
      0x1.8p-24f,
      0x1.4p-24f,
      0x1.0p-14f,
      0x1.ffcp-15f,
      1.0f + 0x1.0p-11f,
      1.0f + 0x1.8p-10f,
      1.0f + 0x1.0p-10f + 0x1.0p-11f,
      2049.0f,
      2051.0f,
      0.5f,
      1.5f,
      2.5f,
      -2.5f,
      3.5f,
      126.5f,
      -126.5f,
  };
  std::mt19937 rng(seed);
  std::uniform_int_distribution<uint32_t> any_bits;
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (size_t i = 0; i < random_count; ++i) {
    switch (i % 4) {
      case 0:
        values.push_back(bits_to_float(any_bits(rng)));
        break;  // every class, NaN payloads
      case 1:
        values.push_back(normal(rng));
        break;
      case 2:
        values.push_back(std::ldexp(normal(rng), -20));
        break;  // f16 denormal range
      default:
        values.push_back(static_cast<float>(static_cast<int>(normal(rng) * 20)) + 0.5f);
        break;
    }
  }
  return values;
}

TEST(Fp16Conversion, GivesTheKnownBitPatternsOfIeeeHalf) {
  const std::pair<float, uint16_t> cases[] = {
      {1.0f, 0x3C00},
      {-2.0f, 0xC000},
      {65504.0f, 0x7BFF},
      {65520.0f, 0x7C00},
      {0.0f, 0x0000},
      {-0.0f, 0x8000},
      {0x1.0p-24f, 0x0001},
      {0x1.0p-25f, 0x0000},
      {0x1.8p-24f, 0x0002},
      {0x1.0p-14f, 0x0400},
      {1.0f + 0x1.0p-11f, 0x3C00},  // tie to even
      {1.0f + 0x1.8p-10f, 0x3C02},  // tie, odd below: rounds up
      {0.333333343f, 0x3555},
      {std::numeric_limits<float>::infinity(), 0x7C00},
      {-std::numeric_limits<float>::infinity(), 0xFC00},
  };
  for (const auto& [value, bits] : cases) EXPECT_EQ(fp32_to_fp16(value), bits) << value;
}

TEST(Fp16Conversion, TurnsEveryNaNIntoTheQuietNaNWithItsSign) {
  EXPECT_EQ(fp32_to_fp16(bits_to_float(0x7FC12345u)), 0x7E00);
  EXPECT_EQ(fp32_to_fp16(bits_to_float(0xFF800001u)), 0xFE00);
}

TEST(RowConvertVector, ProducesTheSameF16BytesAsTheScalarKernel) {
  if (!kernels::cpu_has_avx2_f16c()) GTEST_SKIP() << "this CPU has no AVX2/F16C: only the scalar kernel runs";
  for (size_t offset = 0; offset < 3; ++offset) {
    const std::vector<float> input = awkward_floats(20000 + offset, 7 + static_cast<uint32_t>(offset));
    std::vector<uint16_t> scalar(input.size()), vector(input.size());
    kernels::fp32_to_fp16_scalar(input.data(), scalar.data(), static_cast<int64_t>(input.size()));
    kernels::fp32_to_fp16_avx2(input.data(), vector.data(), static_cast<int64_t>(input.size()));
    for (size_t i = 0; i < input.size(); ++i)
      ASSERT_EQ(vector[i], scalar[i]) << "input bits " << std::hex << std::bit_cast<uint32_t>(input[i]);
  }
}

TEST(RowConvertVector, DecodesEveryHalfToTheSameFloatBitsAsTheScalarKernel) {
  if (!kernels::cpu_has_avx2_f16c()) GTEST_SKIP() << "this CPU has no AVX2/F16C: only the scalar kernel runs";
  std::vector<uint16_t> every(65536 + 5);  // all halves, then a tail shorter than one vector
  for (size_t i = 0; i < every.size(); ++i) every[i] = static_cast<uint16_t>(i * 40503u);
  for (size_t i = 0; i < 65536; ++i) every[i] = static_cast<uint16_t>(i);
  std::vector<float> scalar(every.size()), vector(every.size());
  kernels::fp16_to_fp32_scalar(every.data(), scalar.data(), static_cast<int64_t>(every.size()));
  kernels::fp16_to_fp32_avx2(every.data(), vector.data(), static_cast<int64_t>(every.size()));
  for (size_t i = 0; i < every.size(); ++i)
    ASSERT_EQ(std::bit_cast<uint32_t>(vector[i]), std::bit_cast<uint32_t>(scalar[i]))
        << "half " << std::hex << every[i];
}

TEST(RowConvertVector, ProducesTheSameQ8_0BytesAsTheScalarKernel) {
  if (!kernels::cpu_has_avx2_f16c()) GTEST_SKIP() << "this CPU has no AVX2/F16C: only the scalar kernel runs";
  std::vector<float> input = awkward_floats(32 * 2000, 11);
  input.resize(input.size() / 32 * 32);
  // Blocks built to hit the halfway cases of roundf: amax 127 makes id exactly 1.
  std::vector<float> halfway(32);
  for (int j = 0; j < 32; ++j) halfway[static_cast<size_t>(j)] = static_cast<float>(j - 16) + 0.5f;
  halfway[0] = 127.0f;
  input.insert(input.end(), halfway.begin(), halfway.end());
  // Random blocks of ordinary activations (the common case, no special values).
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (int i = 0; i < 32 * 500; ++i) input.push_back(normal(rng));
  const int64_t n = static_cast<int64_t>(input.size());
  std::vector<std::byte> scalar(ggml_row_size(GgmlType::Q8_0, n)), vector(scalar.size());
  kernels::fp32_to_q8_0_scalar(input.data(), scalar.data(), n);
  kernels::fp32_to_q8_0_avx2(input.data(), vector.data(), n);
  for (size_t b = 0; b < scalar.size() / sizeof(BlockQ8_0); ++b)
    ASSERT_EQ(std::memcmp(scalar.data() + b * 34, vector.data() + b * 34, 34), 0) << "block " << b;
}

TEST(RowConvert, QuantizesAQ8_0BlockAsComputedByHand) {
  // amax 127 -> d = 127/127 = 1 (f16 0x3C00), id = 1: each element rounds half away from 0.
  std::vector<float> x(32);
  for (int j = 0; j < 32; ++j) x[static_cast<size_t>(j)] = static_cast<float>(j - 16);
  x[0] = -127.0f;
  x[1] = 2.5f;   // -> 3 (roundf, not round-half-even)
  x[2] = -2.5f;  // -> -3
  x[3] = 0.49f;  // -> 0
  BlockQ8_0 block{};
  convert_row(GgmlType::F32, x.data(), GgmlType::Q8_0, &block, 32);
  EXPECT_EQ(block.d, 0x3C00);
  EXPECT_EQ(block.qs[0], -127);
  EXPECT_EQ(block.qs[1], 3);
  EXPECT_EQ(block.qs[2], -3);
  EXPECT_EQ(block.qs[3], 0);
  for (int j = 4; j < 32; ++j) EXPECT_EQ(block.qs[j], j - 16) << j;
}

TEST(RowConvert, QuantizesAQ8_0BlockOfZerosToAZeroScale) {
  std::vector<float> x(32, 0.0f);
  BlockQ8_0 block;
  std::memset(&block, 0xAB, sizeof block);
  convert_row(GgmlType::F32, x.data(), GgmlType::Q8_0, &block, 32);
  EXPECT_EQ(block.d, 0);
  for (int8_t q : block.qs) EXPECT_EQ(q, 0);
}

TEST(RowConvert, QuantizesAQ4_0BlockAsComputedByHand) {
  // The signed extreme is -8: d = max / -8 = 1, id = 1, q = (int)(x + 8.5) capped at 15.
  std::vector<float> x(32, 0.0f);
  x[0] = -8.0f;   // 0
  x[1] = 3.0f;    // 11
  x[16] = 7.0f;   // 15
  x[17] = 7.9f;   // 16 -> capped at 15
  x[18] = -7.6f;  // 0.9 -> 0
  BlockQ4_0 block{};
  convert_row(GgmlType::F32, x.data(), GgmlType::Q4_0, &block, 32);
  EXPECT_EQ(block.d, 0x3C00);
  EXPECT_EQ(block.qs[0], 0x0 | (15 << 4));
  EXPECT_EQ(block.qs[1], 11 | (15 << 4));
  EXPECT_EQ(block.qs[2], 8 | (0 << 4));
  EXPECT_EQ(block.qs[3], 8 | (8 << 4));
}

TEST(RowConvert, QuantizesAnIq4NlBlockOnItsOwnLevelsExactly) {
  // x = level/2: d = max/values[0] = 0.5, every element lands on its level index.
  std::vector<float> x(32);
  for (int j = 0; j < 32; ++j) x[static_cast<size_t>(j)] = blocks::kIQ4NLValues[j % 16] * 0.5f;
  std::vector<std::byte> out(ggml_row_size(GgmlType::IQ4_NL, 32));
  convert_row(GgmlType::F32, x.data(), GgmlType::IQ4_NL, out.data(), 32);
  const auto* block = reinterpret_cast<const blocks::BlockIQ4_NL*>(out.data());
  EXPECT_EQ(block->d, 0x3800);  // 0.5
  for (int j = 0; j < 16; ++j) EXPECT_EQ(block->qs[j], (j % 16) | ((j % 16) << 4)) << j;
}

TEST(RowConvert, CopiesF16RowsByteForByte) {
  std::vector<uint16_t> src(512);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint16_t>(i * 977u + 13u);
  src[5] = 0x7C01;  // a signalling NaN survives: a copy never converts
  std::vector<uint16_t> dst(src.size());
  convert_row(GgmlType::F16, src.data(), GgmlType::F16, dst.data(), 512);
  EXPECT_EQ(dst, src);
}

TEST(RowConvert, ConvertsBf16SourcesThroughF32) {
  const uint16_t src[2] = {0x3F80, 0xC040};  // bf16 1.0, -3.0
  uint16_t dst[2];
  convert_row(GgmlType::BF16, src, GgmlType::F16, dst, 2);
  EXPECT_EQ(dst[0], 0x3C00);
  EXPECT_EQ(dst[1], 0xC200);
  float back[2];
  convert_row(GgmlType::BF16, src, GgmlType::F32, back, 2);
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[1], -3.0f);
}

TEST(RowConvert, RoundsF32ToBf16ToNearestEven) {
  const float src[3] = {1.0f + 0x1.0p-8f, 1.0f + 0x1.8p-7f, bits_to_float(0x7F800001u)};
  uint16_t dst[3];
  convert_row(GgmlType::F32, src, GgmlType::BF16, dst, 3);
  EXPECT_EQ(dst[0], 0x3F80);  // tie, even below
  EXPECT_EQ(dst[1], 0x3F82);  // tie, odd below: up
  EXPECT_EQ(dst[2], 0x7FC0);  // NaN forced quiet
}

TEST(RowConvert, RoundTripsEveryQuantizedCacheTypeWithinOneQuantizationStep) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(256);
  for (float& v : x) v = normal(rng);
  for (GgmlType type :
       {GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::IQ4_NL}) {
    std::vector<std::byte> q(ggml_row_size(type, 256));
    std::vector<float> back(256);
    convert_row(GgmlType::F32, x.data(), type, q.data(), 256);
    ASSERT_TRUE(dequantize_row(type, q.data(), back.data(), 256));
    // Per block, the step of these formats is (range / levels): half a step of error, but a
    // full one for q4_0/q5_0 (the far end of the side opposite the extreme is clipped, as
    // ggml's MIN(15, ...) does) and iq4_nl (uneven levels).
    for (int b = 0; b < 8; ++b) {
      float lo = x[static_cast<size_t>(b * 32)], hi = lo;
      for (int j = 0; j < 32; ++j) {
        lo = std::min(lo, x[static_cast<size_t>(b * 32 + j)]);
        hi = std::max(hi, x[static_cast<size_t>(b * 32 + j)]);
      }
      const float amax = std::max(std::fabs(lo), std::fabs(hi));
      const float step = type == GgmlType::Q8_0   ? amax / 127
                         : type == GgmlType::Q5_0 ? amax / 16
                         : type == GgmlType::Q5_1 ? (hi - lo) / 31
                         : type == GgmlType::Q4_1 ? (hi - lo) / 15
                         : type == GgmlType::Q4_0 ? amax / 8
                                                  : amax * 24 / 127;
      for (int j = 0; j < 32; ++j) {
        const size_t i = static_cast<size_t>(b * 32 + j);
        const bool full_step = type == GgmlType::Q4_0 || type == GgmlType::Q5_0 || type == GgmlType::IQ4_NL;
        EXPECT_NEAR(back[i], x[i], step * (full_step ? 1.01f : 0.51f) + 1e-3f * amax)
            << ggml_type_name(type) << " element " << i;
      }
    }
  }
}

TEST(DequantizeRow, DecodesAQ4KBlockAsComputedByHand) {
  BlockQ4_K block{};
  block.d = 0x3C00;                // 1.0
  block.dmin = 0x3800;             // 0.5
  block.scales[0] = 2 | (1 << 6);  // sub-block 0: scale 2; its top bits feed sub-block 4's scale
  block.scales[4] = 3;             // sub-block 0: min 3
  block.scales[1] = 1;             // sub-block 1: scale 1, min 0
  block.scales[8] = 0x23;          // sub-block 4: scale 3 | 1<<4 = 19, min 2
  block.qs[0] = 0x75;              // element 0 = 2*5 - 0.5*3 = 8.5; element 32 = 1*7 - 0 = 7
  block.qs[64] = 0x01;             // element 128 = 19*1 - 0.5*2 = 18
  std::vector<float> y(256);
  ASSERT_TRUE(dequantize_row(GgmlType::Q4_K, &block, y.data(), 256));
  EXPECT_EQ(y[0], 8.5f);
  EXPECT_EQ(y[32], 7.0f);
  EXPECT_EQ(y[128], 18.0f);
  EXPECT_EQ(y[1], -1.5f);  // quant 0: just the min
}

TEST(DequantizeRow, DecodesAQ6KBlockAsComputedByHand) {
  BlockQ6_K block{};
  block.d = 0x3800;  // 0.5
  block.ql[0] = 0x0A;
  block.qh[0] = 0x02;   // element 0: (10 | 2<<4) - 32 = 10
  block.ql[32] = 0x50;  // element 96: (5 | 0<<4) - 32 = -27
  block.scales[0] = -3;
  block.scales[6] = 2;
  std::vector<float> y(256);
  ASSERT_TRUE(dequantize_row(GgmlType::Q6_K, &block, y.data(), 256));
  EXPECT_EQ(y[0], 0.5f * -3 * 10);
  EXPECT_EQ(y[96], 0.5f * 2 * -27);
  EXPECT_EQ(y[1], 0.5f * -3 * -32);
}

TEST(DequantizeRow, RefusesATypeItCannotDecode) {
  std::vector<std::byte> block(84);
  std::vector<float> y(256);
  EXPECT_FALSE(dequantize_row(GgmlType::Q2_K, block.data(), y.data(), 256));
  EXPECT_FALSE(dequantize_row(GgmlType::Q8_0, block.data(), y.data(), 31));
}

TEST(HadamardRotate, EqualsTheProductWithTheSylvesterMatrix) {
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int group : {64, 128}) {
    std::vector<float> x(static_cast<size_t>(group) * 2);
    for (float& v : x) v = normal(rng);
    std::vector<float> rotated = x;
    hadamard_rotate(rotated.data(), static_cast<int64_t>(x.size()), group);
    for (size_t base = 0; base < x.size(); base += static_cast<size_t>(group)) {
      for (int i = 0; i < group; ++i) {
        double expected = 0;
        for (int j = 0; j < group; ++j)
          expected +=
              ((std::popcount(static_cast<unsigned>(i & j)) & 1) ? -1.0 : 1.0) * x[base + static_cast<size_t>(j)];
        expected /= std::sqrt(static_cast<double>(group));
        EXPECT_NEAR(rotated[base + static_cast<size_t>(i)], expected, 1e-4) << group << " " << i;
      }
    }
  }
}

TEST(HadamardRotate, IsItsOwnInverse) {
  std::vector<float> x(256);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 17) - 8.0f;
  std::vector<float> twice = x;
  hadamard_rotate(twice.data(), 256, 64);
  hadamard_rotate(twice.data(), 256, 64);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(twice[i], x[i], 1e-5f);
}

TEST(KvRotationGroup, FollowsLlamaCppsRulesForKAndV) {
  EXPECT_EQ(kv_rotation_group(TensorKind::k, GgmlType::Q8_0, 128, false), 128);
  EXPECT_EQ(kv_rotation_group(TensorKind::k, GgmlType::Q8_0, 192, false), 64);
  EXPECT_EQ(kv_rotation_group(TensorKind::k, GgmlType::Q4_0, 256, false), 256);
  EXPECT_EQ(kv_rotation_group(TensorKind::k, GgmlType::Q8_0, 64, false), 64);
  EXPECT_EQ(kv_rotation_group(TensorKind::v, GgmlType::Q8_0, 128, false), 64);
  EXPECT_EQ(kv_rotation_group(TensorKind::k, GgmlType::F16, 128, false), 0);
  EXPECT_EQ(kv_rotation_group(TensorKind::k, GgmlType::Q8_0, 80, false), 0);
  EXPECT_EQ(kv_rotation_group(TensorKind::v, GgmlType::Q8_0, 96, false), 0);
  EXPECT_EQ(kv_rotation_group(TensorKind::k, GgmlType::Q8_0, 128, true), 0);
  EXPECT_EQ(kv_rotation_group(TensorKind::r, GgmlType::Q8_0, 128, false), 0);
}

TEST(RowConvert, RotatesBeforeQuantizingSoTheInverseRotationRestoresTheRow) {
  std::mt19937 rng(13);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(256);
  for (float& v : x) v = normal(rng);
  x[7] = 40.0f;  // an outlier the rotation spreads over its group
  std::vector<std::byte> q(ggml_row_size(GgmlType::Q8_0, 256));
  convert_row(GgmlType::F32, x.data(), GgmlType::Q8_0, q.data(), 256, 128);
  // Quantizing the rotated row directly gives the same bytes.
  std::vector<float> rotated = x;
  hadamard_rotate(rotated.data(), 256, 128);
  std::vector<std::byte> expected(q.size());
  kernels::fp32_to_q8_0_scalar(rotated.data(), expected.data(), 256);
  EXPECT_EQ(q, expected);
  std::vector<float> back(256);
  ASSERT_TRUE(dequantize_row(GgmlType::Q8_0, q.data(), back.data(), 256));
  hadamard_rotate(back.data(), 256, 128);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(back[i], x[i], 0.05f) << i;
}

TEST(RowConvert, RotatesF16SourcesInSlicesLongerThanTheStackBuffer) {
  std::vector<uint16_t> src(4096);
  std::vector<float> as_f32(src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    src[i] = fp32_to_fp16(std::sin(static_cast<float>(i)) * 3.0f);
    as_f32[i] = fp16_to_fp32(src[i]);
  }
  std::vector<std::byte> from_f16(ggml_row_size(GgmlType::Q8_0, 4096)), from_f32(from_f16.size());
  convert_row(GgmlType::F16, src.data(), GgmlType::Q8_0, from_f16.data(), 4096, 2048);
  convert_row(GgmlType::F32, as_f32.data(), GgmlType::Q8_0, from_f32.data(), 4096, 2048);
  EXPECT_EQ(from_f16, from_f32);
}

TEST(RowConvert, NamesTheBackendThisCpuUses) {
  const std::string name = convert_backend_name();
  EXPECT_EQ(name, kernels::cpu_has_avx2_f16c() ? "avx2+f16c" : "scalar");
}

TEST(RowConvert, ClassifiesSourceAndCacheTypes) {
  EXPECT_TRUE(is_source_type(GgmlType::BF16));
  EXPECT_FALSE(is_source_type(GgmlType::Q8_0));
  EXPECT_TRUE(is_cache_type(GgmlType::IQ4_NL));
  EXPECT_FALSE(is_cache_type(GgmlType::Q4_K));
}

}  // namespace
}  // namespace kvshare::layout

namespace kvshare::layout {
namespace {

TEST(RowConvertStreaming, WritesTheSameBytesAsConvertRowAtAnyAlignment) {
  const std::vector<float> input = awkward_floats(3000, 21);
  std::vector<uint16_t> as_f16(input.size());
  kernels::fp32_to_fp16_scalar(input.data(), as_f16.data(), static_cast<int64_t>(input.size()));
  for (size_t shift = 0; shift < 5; ++shift) {
    for (int64_t n : {1, 15, 16, 17, 640, 2048}) {
      std::vector<uint16_t> plain(n + 8), streamed(n + 8);
      convert_row(GgmlType::F32, input.data(), GgmlType::F16, plain.data() + shift, n);
      convert_row_streaming(GgmlType::F32, input.data(), GgmlType::F16, streamed.data() + shift, n);
      std::vector<uint16_t> copied(n + 8);
      convert_row_streaming(GgmlType::F16, as_f16.data(), GgmlType::F16, copied.data() + shift, n);
      convert_stream_fence();
      EXPECT_EQ(plain, streamed) << "shift " << shift << " n " << n;
      EXPECT_TRUE(std::equal(as_f16.begin(), as_f16.begin() + n, copied.begin() + static_cast<int64_t>(shift)))
          << "shift " << shift << " n " << n;
    }
  }
}

}  // namespace
}  // namespace kvshare::layout
