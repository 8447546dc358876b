// ggml's quantized block layouts (ggml/src/ggml-common.h), byte for byte. Every struct is
// trivially copyable with no padding, so a cache or weight row is an array of them; the
// static_asserts pin the sizes to the ones tensor_type.cc lists.
#pragma once

#include <cstdint>

namespace kvshare::layout::blocks {

inline constexpr int kQK4_0 = 32;
inline constexpr int kQK4_1 = 32;
inline constexpr int kQK5_0 = 32;
inline constexpr int kQK5_1 = 32;
inline constexpr int kQK8_0 = 32;
inline constexpr int kQK4_NL = 32;
inline constexpr int kQK_K = 256;
inline constexpr int kKScaleSize = 12;

// Half-precision values are kept as raw bits: layout/half.h converts them.
struct BlockQ4_0 {
  uint16_t d;              // scale, f16
  uint8_t qs[kQK4_0 / 2];  // element j in the low nibble of qs[j], j+16 in the high one
};
struct BlockQ4_1 {
  uint16_t d;  // scale, f16
  uint16_t m;  // minimum, f16
  uint8_t qs[kQK4_1 / 2];
};
struct BlockQ5_0 {
  uint16_t d;
  uint8_t qh[4];  // fifth bit of element j at bit j (little-endian uint32)
  uint8_t qs[kQK5_0 / 2];
};
struct BlockQ5_1 {
  uint16_t d;
  uint16_t m;
  uint8_t qh[4];
  uint8_t qs[kQK5_1 / 2];
};
struct BlockQ8_0 {
  uint16_t d;
  int8_t qs[kQK8_0];
};
struct BlockIQ4_NL {
  uint16_t d;
  uint8_t qs[kQK4_NL / 2];  // indices into kIQ4NLValues
};
struct BlockQ4_K {
  uint16_t d;                   // super-block scale for the 6-bit scales
  uint16_t dmin;                // super-block scale for the 6-bit mins
  uint8_t scales[kKScaleSize];  // 8 scales and 8 mins, 6 bits each
  uint8_t qs[kQK_K / 2];
};
struct BlockQ5_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[kKScaleSize];
  uint8_t qh[kQK_K / 8];
  uint8_t qs[kQK_K / 2];
};
struct BlockQ6_K {
  uint8_t ql[kQK_K / 2];      // low 4 bits
  uint8_t qh[kQK_K / 4];      // high 2 bits
  int8_t scales[kQK_K / 16];  // 16 sub-block scales
  uint16_t d;
};
struct BlockQ8_K {
  float d;  // a plain f32 scale, unlike every other block
  int8_t qs[kQK_K];
  int16_t bsums[kQK_K / 16];
};

static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ5_0) == 22 &&
              sizeof(BlockQ5_1) == 24 && sizeof(BlockQ8_0) == 34 && sizeof(BlockIQ4_NL) == 18);
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210 &&
              sizeof(BlockQ8_K) == 292);

// kvalues_iq4nl (ggml-common.h): the 16 non-linear levels of iq4_nl.
inline constexpr int8_t kIQ4NLValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

}  // namespace kvshare::layout::blocks
