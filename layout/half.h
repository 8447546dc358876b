// Scalar IEEE half and bfloat16 conversions with ggml's rounding (round to nearest even,
// NaN kept quiet). The vector paths in row_convert.cc must give the same bits.
#pragma once

#include <bit>
#include <cstdint>

namespace kvshare::layout {

// ggml_compute_fp32_to_fp16 (the non-F16C path of ggml-impl.h).
inline uint16_t fp32_to_fp16(float f) {
  constexpr float scale_to_inf = 0x1.0p+112f;
  constexpr float scale_to_zero = 0x1.0p-110f;
  float base = (std::bit_cast<float>(std::bit_cast<uint32_t>(f) & 0x7FFFFFFFu) * scale_to_inf) * scale_to_zero;
  const uint32_t w = std::bit_cast<uint32_t>(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = std::bit_cast<float>((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = std::bit_cast<uint32_t>(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// ggml_compute_fp16_to_fp32.
inline float fp16_to_fp32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  constexpr uint32_t exp_offset = 0xE0u << 23;
  constexpr float exp_scale = 0x1.0p-112f;
  const float normalized_value = std::bit_cast<float>((two_w >> 4) + exp_offset) * exp_scale;
  constexpr uint32_t magic_mask = 126u << 23;
  constexpr float magic_bias = 0.5f;
  const float denormalized_value = std::bit_cast<float>((two_w >> 17) | magic_mask) - magic_bias;
  constexpr uint32_t denormalized_cutoff = 1u << 27;
  const uint32_t result = sign | (two_w < denormalized_cutoff ? std::bit_cast<uint32_t>(denormalized_value)
                                                              : std::bit_cast<uint32_t>(normalized_value));
  return std::bit_cast<float>(result);
}

// ggml_compute_fp32_to_bf16: round to nearest even, NaN forced quiet.
inline uint16_t fp32_to_bf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 64u);
  return static_cast<uint16_t>((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}

inline float bf16_to_fp32(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

}  // namespace kvshare::layout
