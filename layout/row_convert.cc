// Scalar conversions, bit-exact with ggml/src/ggml-quants.c (quantize_row_*_ref,
// dequantize_row_*) at the commit the specs describe, and the dispatch to the vector
// kernels of row_convert_avx2.cc.
#include "layout/row_convert.h"

#include <cpuid.h>

#include <algorithm>
#include <cassert>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "layout/half.h"
#include "layout/q_types.h"
#include "layout/row_convert_kernels.h"

namespace kvshare::layout {
namespace {

using namespace blocks;

// What x86 code compiled from ggml's C does for `(int8_t)f`, `(uint8_t)f` and
// `int8_t q = roundf(f)`: cvttss2si to 32 bits (0x80000000 for NaN and out-of-range
// values), then keep the low byte. Written out because the C++ cast is undefined for
// those inputs, and NaN or Inf can reach a quantizer through a broken activation.
inline int32_t trunc_to_int32(float f) {
  if (!(f > -2147483904.0f && f < 2147483648.0f)) return INT32_MIN;
  return static_cast<int32_t>(f);
}
inline int8_t trunc_to_int8(float f) { return static_cast<int8_t>(static_cast<uint8_t>(trunc_to_int32(f) & 0xFF)); }
inline uint8_t trunc_to_uint8(float f) { return static_cast<uint8_t>(trunc_to_int32(f) & 0xFF); }

// ggml's MIN/MAX macros, whose NaN behaviour (a comparison, not fmin) the bytes depend on.
template <class T>
inline T ggml_min(T a, T b) {
  return a < b ? a : b;
}
template <class T>
inline T ggml_max(T a, T b) {
  return a > b ? a : b;
}

void quantize_q4_0(const float* x, BlockQ4_0* y, int64_t n) {
  for (int64_t i = 0; i < n / kQK4_0; ++i, x += kQK4_0) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < kQK4_0; ++j) {
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    }
    const float d = max / -8;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = fp32_to_fp16(d);
    for (int j = 0; j < kQK4_0 / 2; ++j) {
      const auto xi0 = static_cast<uint8_t>(ggml_min<int>(15, trunc_to_int8(x[j] * id + 8.5f)));
      const auto xi1 = static_cast<uint8_t>(ggml_min<int>(15, trunc_to_int8(x[kQK4_0 / 2 + j] * id + 8.5f)));
      y[i].qs[j] = static_cast<uint8_t>(xi0 | (xi1 << 4));
    }
  }
}

void quantize_q4_1(const float* x, BlockQ4_1* y, int64_t n) {
  for (int64_t i = 0; i < n / kQK4_1; ++i, x += kQK4_1) {
    float min = FLT_MAX, max = -FLT_MAX;
    for (int j = 0; j < kQK4_1; ++j) {
      if (x[j] < min) min = x[j];
      if (x[j] > max) max = x[j];
    }
    const float d = (max - min) / ((1 << 4) - 1);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = fp32_to_fp16(d);
    y[i].m = fp32_to_fp16(min);
    for (int j = 0; j < kQK4_1 / 2; ++j) {
      const auto xi0 = static_cast<uint8_t>(ggml_min<int>(15, trunc_to_int8((x[j] - min) * id + 0.5f)));
      const auto xi1 = static_cast<uint8_t>(ggml_min<int>(15, trunc_to_int8((x[kQK4_1 / 2 + j] - min) * id + 0.5f)));
      y[i].qs[j] = static_cast<uint8_t>(xi0 | (xi1 << 4));
    }
  }
}

void quantize_q5_0(const float* x, BlockQ5_0* y, int64_t n) {
  for (int64_t i = 0; i < n / kQK5_0; ++i, x += kQK5_0) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < kQK5_0; ++j) {
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    }
    const float d = max / -16;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = fp32_to_fp16(d);
    uint32_t qh = 0;
    for (int j = 0; j < kQK5_0 / 2; ++j) {
      const auto xi0 = static_cast<uint8_t>(ggml_min<int>(31, trunc_to_int8(x[j] * id + 16.5f)));
      const auto xi1 = static_cast<uint8_t>(ggml_min<int>(31, trunc_to_int8(x[kQK5_0 / 2 + j] * id + 16.5f)));
      y[i].qs[j] = static_cast<uint8_t>((xi0 & 0x0F) | ((xi1 & 0x0F) << 4));
      qh |= ((xi0 & 0x10u) >> 4) << (j + 0);
      qh |= ((xi1 & 0x10u) >> 4) << (j + kQK5_0 / 2);
    }
    std::memcpy(y[i].qh, &qh, sizeof qh);
  }
}

void quantize_q5_1(const float* x, BlockQ5_1* y, int64_t n) {
  for (int64_t i = 0; i < n / kQK5_1; ++i, x += kQK5_1) {
    float min = FLT_MAX, max = -FLT_MAX;
    for (int j = 0; j < kQK5_1; ++j) {
      if (x[j] < min) min = x[j];
      if (x[j] > max) max = x[j];
    }
    const float d = (max - min) / ((1 << 5) - 1);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = fp32_to_fp16(d);
    y[i].m = fp32_to_fp16(min);
    uint32_t qh = 0;
    for (int j = 0; j < kQK5_1 / 2; ++j) {
      const uint8_t xi0 = trunc_to_uint8((x[j] - min) * id + 0.5f);
      const uint8_t xi1 = trunc_to_uint8((x[kQK5_1 / 2 + j] - min) * id + 0.5f);
      y[i].qs[j] = static_cast<uint8_t>((xi0 & 0x0F) | ((xi1 & 0x0F) << 4));
      qh |= ((xi0 & 0x10u) >> 4) << (j + 0);
      qh |= ((xi1 & 0x10u) >> 4) << (j + kQK5_1 / 2);
    }
    std::memcpy(y[i].qh, &qh, sizeof qh);
  }
}

// best_index_int8 (ggml-quants.c): the nearest of the sorted levels, ties to the upper.
int best_index_int8(int n, const int8_t* val, float x) {
  if (x <= val[0]) return 0;
  if (x >= val[n - 1]) return n - 1;
  int ml = 0, mu = n - 1;
  while (mu - ml > 1) {
    const int mav = (ml + mu) / 2;
    if (x < val[mav])
      mu = mav;
    else
      ml = mav;
  }
  return x - val[mu - 1] < val[mu] - x ? mu - 1 : mu;
}

// quantize_row_iq4_nl_ref = quantize_row_iq4_nl_impl(32, 32, ..., quant_weights NULL,
// ntry -1): one block per super-block, so the scales_h/scales_l branch never runs and,
// with ntry < 0, the scale search loop and the final re-quantisation are skipped.
void quantize_iq4_nl(const float* x, BlockIQ4_NL* y, int64_t n) {
  constexpr float kGroupMaxEps = 1e-15f;
  const int8_t* values = kIQ4NLValues;
  // One level array for the whole row, as ggml's caller passes one L to every block: a
  // block below GROUP_MAX_EPS skips the search and writes the previous block's levels
  // (with d = 0, so they decode to zeros). ggml leaves L uninitialised for a first such
  // block; ours starts at zero.
  uint8_t levels[kQK4_NL] = {};
  for (int64_t ib = 0; ib < n / kQK4_NL; ++ib, x += kQK4_NL) {
    std::memset(y[ib].qs, 0, sizeof y[ib].qs);
    float weight[kQK4_NL];
    for (int j = 0; j < kQK4_NL; ++j) weight[j] = x[j] * x[j];
    float amax = 0, max = 0;
    for (int j = 0; j < kQK4_NL; ++j) {
      const float ax = std::fabs(x[j]);
      if (ax > amax) {
        amax = ax;
        max = x[j];
      }
    }
    float scale = 0;
    if (!(amax < kGroupMaxEps)) {
      float d = max / values[0];  // ntry -1: not > 0
      const float id = 1 / d;
      float sumqx = 0, sumq2 = 0;
      for (int j = 0; j < kQK4_NL; ++j) {
        const int l = best_index_int8(16, values, id * x[j]);
        levels[j] = static_cast<uint8_t>(l);
        const float q = values[l];
        const float w = weight[j];
        sumqx += w * q * x[j];
        sumq2 += w * q * q;
      }
      d = sumq2 > 0 ? sumqx / sumq2 : 0.f;
      scale = d;
    }
    y[ib].d = fp32_to_fp16(scale);
    for (int j = 0; j < 16; ++j) y[ib].qs[j] = static_cast<uint8_t>(levels[j] | (levels[16 + j] << 4));
  }
}

void dequantize_q4_0(const BlockQ4_0* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n / kQK4_0; ++i, y += kQK4_0) {
    const float d = fp16_to_fp32(x[i].d);
    for (int j = 0; j < kQK4_0 / 2; ++j) {
      y[j] = static_cast<float>((x[i].qs[j] & 0x0F) - 8) * d;
      y[j + kQK4_0 / 2] = static_cast<float>((x[i].qs[j] >> 4) - 8) * d;
    }
  }
}

void dequantize_q4_1(const BlockQ4_1* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n / kQK4_1; ++i, y += kQK4_1) {
    const float d = fp16_to_fp32(x[i].d), m = fp16_to_fp32(x[i].m);
    for (int j = 0; j < kQK4_1 / 2; ++j) {
      const float p0 = static_cast<float>(x[i].qs[j] & 0x0F) * d;
      const float p1 = static_cast<float>(x[i].qs[j] >> 4) * d;
      y[j] = p0 + m;
      y[j + kQK4_1 / 2] = p1 + m;
    }
  }
}

void dequantize_q5_0(const BlockQ5_0* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n / kQK5_0; ++i, y += kQK5_0) {
    const float d = fp16_to_fp32(x[i].d);
    uint32_t qh;
    std::memcpy(&qh, x[i].qh, sizeof qh);
    for (int j = 0; j < kQK5_0 / 2; ++j) {
      const uint8_t xh0 = ((qh >> j) << 4) & 0x10;
      const uint8_t xh1 = (qh >> (j + 12)) & 0x10;
      y[j] = static_cast<float>(((x[i].qs[j] & 0x0F) | xh0) - 16) * d;
      y[j + kQK5_0 / 2] = static_cast<float>(((x[i].qs[j] >> 4) | xh1) - 16) * d;
    }
  }
}

void dequantize_q5_1(const BlockQ5_1* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n / kQK5_1; ++i, y += kQK5_1) {
    const float d = fp16_to_fp32(x[i].d), m = fp16_to_fp32(x[i].m);
    uint32_t qh;
    std::memcpy(&qh, x[i].qh, sizeof qh);
    for (int j = 0; j < kQK5_1 / 2; ++j) {
      const uint8_t xh0 = ((qh >> j) << 4) & 0x10;
      const uint8_t xh1 = (qh >> (j + 12)) & 0x10;
      const float p0 = static_cast<float>((x[i].qs[j] & 0x0F) | xh0) * d;
      const float p1 = static_cast<float>((x[i].qs[j] >> 4) | xh1) * d;
      y[j] = p0 + m;
      y[j + kQK5_1 / 2] = p1 + m;
    }
  }
}

void dequantize_q8_0(const BlockQ8_0* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n / kQK8_0; ++i, y += kQK8_0) {
    const float d = fp16_to_fp32(x[i].d);
    for (int j = 0; j < kQK8_0; ++j) y[j] = static_cast<float>(x[i].qs[j]) * d;
  }
}

void dequantize_iq4_nl(const BlockIQ4_NL* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n / kQK4_NL; ++i, y += kQK4_NL) {
    const float d = fp16_to_fp32(x[i].d);
    for (int j = 0; j < kQK4_NL / 2; ++j) {
      y[j] = d * static_cast<float>(kIQ4NLValues[x[i].qs[j] & 0xF]);
      y[j + kQK4_NL / 2] = d * static_cast<float>(kIQ4NLValues[x[i].qs[j] >> 4]);
    }
  }
}

// get_scale_min_k4 (ggml-quants.c): the j-th 6-bit scale and min of a q4_K/q5_K block.
void scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4));
  }
}

void dequantize_q4_K(const BlockQ4_K* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n / kQK_K; ++i) {
    const uint8_t* q = x[i].qs;
    const float d = fp16_to_fp32(x[i].d), min = fp16_to_fp32(x[i].dmin);
    int is = 0;
    for (int j = 0; j < kQK_K; j += 64) {
      uint8_t sc, m;
      scale_min_k4(is + 0, x[i].scales, &sc, &m);
      const float d1 = d * sc, m1 = min * m;
      scale_min_k4(is + 1, x[i].scales, &sc, &m);
      const float d2 = d * sc, m2 = min * m;
      for (int l = 0; l < 32; ++l) {
        const float p = d1 * static_cast<float>(q[l] & 0xF);
        *y++ = p - m1;
      }
      for (int l = 0; l < 32; ++l) {
        const float p = d2 * static_cast<float>(q[l] >> 4);
        *y++ = p - m2;
      }
      q += 32;
      is += 2;
    }
  }
}

void dequantize_q5_K(const BlockQ5_K* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n / kQK_K; ++i) {
    const uint8_t* ql = x[i].qs;
    const uint8_t* qh = x[i].qh;
    const float d = fp16_to_fp32(x[i].d), min = fp16_to_fp32(x[i].dmin);
    int is = 0;
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0; j < kQK_K; j += 64) {
      uint8_t sc, m;
      scale_min_k4(is + 0, x[i].scales, &sc, &m);
      const float d1 = d * sc, m1 = min * m;
      scale_min_k4(is + 1, x[i].scales, &sc, &m);
      const float d2 = d * sc, m2 = min * m;
      for (int l = 0; l < 32; ++l) {
        const float p = d1 * static_cast<float>((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0));
        *y++ = p - m1;
      }
      for (int l = 0; l < 32; ++l) {
        const float p = d2 * static_cast<float>((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0));
        *y++ = p - m2;
      }
      ql += 32;
      is += 2;
      u1 = static_cast<uint8_t>(u1 << 2);
      u2 = static_cast<uint8_t>(u2 << 2);
    }
  }
}

void dequantize_q6_K(const BlockQ6_K* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n / kQK_K; ++i) {
    const float d = fp16_to_fp32(x[i].d);
    const uint8_t* ql = x[i].ql;
    const uint8_t* qh = x[i].qh;
    const int8_t* sc = x[i].scales;
    for (int chunk = 0; chunk < kQK_K; chunk += 128) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const auto q1 = static_cast<int8_t>(((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
        const auto q2 = static_cast<int8_t>(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
        const auto q3 = static_cast<int8_t>(((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
        const auto q4 = static_cast<int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        // (d * scale) * q, in that order, as ggml's left-to-right expression.
        y[l + 0] = d * static_cast<float>(sc[is + 0]) * static_cast<float>(q1);
        y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
        y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
        y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
      }
      y += 128;
      ql += 64;
      qh += 32;
      sc += 8;
    }
  }
}

void dequantize_q8_K(const BlockQ8_K* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n / kQK_K; ++i) {
    float d;
    std::memcpy(&d, &x[i].d, sizeof d);
    for (int j = 0; j < kQK_K; ++j) *y++ = d * static_cast<float>(x[i].qs[j]);
  }
}

// The kernels convert_row uses on this CPU, chosen once.
struct Backend {
  void (*fp32_to_fp16)(const float*, uint16_t*, int64_t);
  void (*fp32_to_q8_0)(const float*, void*, int64_t);
  void (*fp16_to_fp32)(const uint16_t*, float*, int64_t);
  void (*copy)(void*, const void*, size_t);
  void (*copy_stream)(void*, const void*, size_t);                // fence left to the caller
  void (*fp32_to_fp16_stream)(const float*, uint16_t*, int64_t);  // fence left to the caller
  void (*fence)();
  const char* name;
};

void no_fence() {}

const Backend& backend() {
  static const Backend chosen = kernels::cpu_has_avx2_f16c() ? Backend{kernels::fp32_to_fp16_avx2,
                                                                       kernels::fp32_to_q8_0_avx2,
                                                                       kernels::fp16_to_fp32_avx2,
                                                                       kernels::copy_bytes_streaming_avx2,
                                                                       kernels::copy_bytes_stream_nofence_avx2,
                                                                       kernels::fp32_to_fp16_stream_nofence_avx2,
                                                                       kernels::store_fence,
                                                                       "avx2+f16c"}
                                                             : Backend{kernels::fp32_to_fp16_scalar,
                                                                       kernels::fp32_to_q8_0_scalar,
                                                                       kernels::fp16_to_fp32_scalar,
                                                                       kernels::copy_bytes,
                                                                       kernels::copy_bytes,
                                                                       kernels::fp32_to_fp16_scalar,
                                                                       no_fence,
                                                                       "scalar"};
  return chosen;
}

// Source row -> f32.
void source_to_fp32(GgmlType src_type, const void* src, float* dst, int64_t n) {
  if (n == 0) return;  // a row of no elements (LFM2's S state) may have no address
  switch (src_type) {
    case GgmlType::F32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case GgmlType::F16:
      backend().fp16_to_fp32(static_cast<const uint16_t*>(src), dst, n);
      return;
    case GgmlType::BF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_fp32(s[i]);
      return;
    }
    default:
      assert(false && "not a source type");
      return;
  }
}

// f32 -> cache type, n a multiple of the destination block size.
void fp32_to_cache(const float* src, GgmlType dst_type, void* dst, int64_t n) {
  switch (dst_type) {
    case GgmlType::F32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case GgmlType::F16:
      backend().fp32_to_fp16(src, static_cast<uint16_t*>(dst), n);
      return;
    case GgmlType::BF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = fp32_to_bf16(src[i]);
      return;
    }
    case GgmlType::Q8_0:
      backend().fp32_to_q8_0(src, dst, n);
      return;
    case GgmlType::Q4_0:
      quantize_q4_0(src, static_cast<BlockQ4_0*>(dst), n);
      return;
    case GgmlType::Q4_1:
      quantize_q4_1(src, static_cast<BlockQ4_1*>(dst), n);
      return;
    case GgmlType::Q5_0:
      quantize_q5_0(src, static_cast<BlockQ5_0*>(dst), n);
      return;
    case GgmlType::Q5_1:
      quantize_q5_1(src, static_cast<BlockQ5_1*>(dst), n);
      return;
    case GgmlType::IQ4_NL:
      quantize_iq4_nl(src, static_cast<BlockIQ4_NL*>(dst), n);
      return;
    default:
      assert(false && "not a cache type");
      return;
  }
}

}  // namespace

namespace kernels {

bool cpu_has_avx2_f16c() {
  // F16C from CPUID leaf 1 (ECX bit 29): clang 14's __builtin_cpu_supports does not know
  // the "f16c" feature name, gcc does; cpuid works with both.
  static const bool has = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
    const bool has_f16c = (ecx & (1u << 29)) != 0;
    return has_f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return has;
}

void fp32_to_fp16_scalar(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
}

// quantize_row_q8_0_ref.
void fp32_to_q8_0_scalar(const float* src, void* dst, int64_t n) {
  auto* y = static_cast<BlockQ8_0*>(dst);
  for (int64_t i = 0; i < n / kQK8_0; ++i, src += kQK8_0) {
    float amax = 0.0f;
    for (int j = 0; j < kQK8_0; ++j) amax = ggml_max(amax, std::fabs(src[j]));
    const float d = amax / ((1 << 7) - 1);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[i].d = fp32_to_fp16(d);
    for (int j = 0; j < kQK8_0; ++j) y[i].qs[j] = trunc_to_int8(std::round(src[j] * id));
  }
}

void fp16_to_fp32_scalar(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_fp32(src[i]);
}

void copy_bytes(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }

}  // namespace kernels

bool is_source_type(GgmlType type) { return type == GgmlType::F32 || type == GgmlType::F16 || type == GgmlType::BF16; }

bool is_cache_type(GgmlType type) {
  switch (type) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
    case GgmlType::Q8_0:
    case GgmlType::Q4_0:
    case GgmlType::Q4_1:
    case GgmlType::Q5_0:
    case GgmlType::Q5_1:
    case GgmlType::IQ4_NL:
      return true;
    default:
      return false;
  }
}

void convert_row(GgmlType src_type, const void* src, GgmlType dst_type, void* dst, int64_t n, int rotation_group) {
  assert(is_source_type(src_type) && is_cache_type(dst_type));
  assert(n % ggml_traits(dst_type).block_size == 0);
  assert(rotation_group == 0 || n % rotation_group == 0);
  if (n <= 0) return;

  // Same type, no rotation: the bytes are the row (ggml's set_rows memcpy's f16 -> f16).
  if (rotation_group == 0 && src_type == dst_type) {
    backend().copy(dst, src, ggml_row_size(dst_type, n));
    return;
  }
  if (rotation_group == 0 && src_type == GgmlType::F32) {
    fp32_to_cache(static_cast<const float*>(src), dst_type, dst, n);
    return;
  }

  // Through an f32 buffer, in slices that hold whole blocks and whole rotation groups:
  // 1024 is a multiple of every block size (32) and of every power-of-two group up to it.
  const int64_t slice = std::max<int64_t>(1024, rotation_group);
  float stack_buffer[1024];
  std::vector<float> heap_buffer;
  float* buffer = stack_buffer;
  if (slice > 1024) {
    heap_buffer.resize(static_cast<size_t>(slice));
    buffer = heap_buffer.data();
  }
  const uint64_t src_element_bytes = ggml_row_size(src_type, 1);
  const auto* src_bytes = static_cast<const unsigned char*>(src);
  auto* dst_bytes = static_cast<unsigned char*>(dst);
  for (int64_t start = 0; start < n; start += slice) {
    const int64_t count = std::min(slice, n - start);
    source_to_fp32(src_type, src_bytes + static_cast<uint64_t>(start) * src_element_bytes, buffer, count);
    if (rotation_group > 0) hadamard_rotate(buffer, count, rotation_group);
    fp32_to_cache(buffer, dst_type, dst_bytes + ggml_row_size(dst_type, start), count);
  }
}

void convert_row_streaming(GgmlType src_type, const void* src, GgmlType dst_type, void* dst, int64_t n,
                           int rotation_group) {
  if (rotation_group == 0 && src_type == dst_type) {
    backend().copy_stream(dst, src, ggml_row_size(dst_type, n));
  } else if (rotation_group == 0 && src_type == GgmlType::F32 && dst_type == GgmlType::F16) {
    backend().fp32_to_fp16_stream(static_cast<const float*>(src), static_cast<uint16_t*>(dst), n);
  } else {
    convert_row(src_type, src, dst_type, dst, n, rotation_group);
  }
}

void convert_stream_fence() { backend().fence(); }

bool dequantize_row(GgmlType type, const void* src, float* dst, int64_t n) {
  if (n < 0 || !is_row_aligned(type, n)) return false;
  switch (type) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
      source_to_fp32(type, src, dst, n);
      return true;
    case GgmlType::Q4_0:
      dequantize_q4_0(static_cast<const BlockQ4_0*>(src), dst, n);
      return true;
    case GgmlType::Q4_1:
      dequantize_q4_1(static_cast<const BlockQ4_1*>(src), dst, n);
      return true;
    case GgmlType::Q5_0:
      dequantize_q5_0(static_cast<const BlockQ5_0*>(src), dst, n);
      return true;
    case GgmlType::Q5_1:
      dequantize_q5_1(static_cast<const BlockQ5_1*>(src), dst, n);
      return true;
    case GgmlType::Q8_0:
      dequantize_q8_0(static_cast<const BlockQ8_0*>(src), dst, n);
      return true;
    case GgmlType::IQ4_NL:
      dequantize_iq4_nl(static_cast<const BlockIQ4_NL*>(src), dst, n);
      return true;
    case GgmlType::Q4_K:
      dequantize_q4_K(static_cast<const BlockQ4_K*>(src), dst, n);
      return true;
    case GgmlType::Q5_K:
      dequantize_q5_K(static_cast<const BlockQ5_K*>(src), dst, n);
      return true;
    case GgmlType::Q6_K:
      dequantize_q6_K(static_cast<const BlockQ6_K*>(src), dst, n);
      return true;
    case GgmlType::Q8_K:
      dequantize_q8_K(static_cast<const BlockQ8_K*>(src), dst, n);
      return true;
    default:
      return false;
  }
}

// ggml_compute_forward_fwht_f32 (ggml-cpu/ops.cpp), which is what llama.cpp's CPU backend
// runs for llama_mul_mat_hadamard (GGML_HINT_SRC0_IS_HADAMARD): scale by 1/sqrtf(n) first,
// then in-place butterflies u+v / u-v with span 1, 2, 4, ... That equals the product with
// ggml_gen_hadamard's Sylvester matrix H[i][j] = (-1)^popcount(i&j) / sqrt(n) up to float
// rounding, and matches the CPU backend bit for bit (its SIMD passes do the same adds).
void hadamard_rotate(float* data, int64_t n, int group) {
  assert(group > 0 && (group & (group - 1)) == 0 && n % group == 0);
  const float scale = 1.0f / std::sqrt(static_cast<float>(group));
  for (int64_t base = 0; base < n; base += group) {
    float* row = data + base;
    for (int j = 0; j < group; ++j) row[j] *= scale;
    for (int len = 1; len < group; len <<= 1) {
      for (int i = 0; i < group; i += 2 * len) {
        for (int j = 0; j < len; ++j) {
          const float u = row[i + j];
          const float v = row[i + len + j];
          row[i + j] = u + v;
          row[i + len + j] = u - v;
        }
      }
    }
  }
}

// llama_kv_cache's constructor and build_input_{k,v}_rot (src/llama-kv-cache.cpp):
// attn_rot_k = quantized type_k and n_embd_head_k % 64 == 0; its matrix is the largest
// power of two >= 64 dividing the head size. attn_rot_v = quantized type_v and
// n_embd_head_v % 64 == 0; its matrix is always 64 (smaller matrices suit V better, per
// the upstream comment). llama.cpp also turns rotation off when the owned layers disagree
// on the head size (n_embd_head_*_all = -1); a caller passes 0 then.
int kv_rotation_group(TensorKind kind, GgmlType cache_type, uint32_t n_embd_head, bool rotation_disabled) {
  if (rotation_disabled || n_embd_head == 0 || !is_quantized(cache_type) || n_embd_head % 64 != 0) return 0;
  if (kind == TensorKind::v) return 64;
  if (kind != TensorKind::k) return 0;
  int group = 64;
  while (n_embd_head % static_cast<uint32_t>(group * 2) == 0) group *= 2;
  return group;
}

const char* convert_backend_name() { return backend().name; }

}  // namespace kvshare::layout
