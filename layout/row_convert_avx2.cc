// AVX2/F16C kernels for the conversions a scatter spends its time in. Compiled with
// per-function target attributes, never -mavx2 for the whole library: the library must
// still load on a CPU without AVX2, and convert_row only calls these after
// __builtin_cpu_supports said yes. Each kernel gives the same bytes as its scalar twin in
// row_convert.cc (tests/layout/row_convert_test.cc checks that on NaN, Inf, denormals,
// signed zeros and halfway cases).
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "layout/half.h"
#include "layout/q_types.h"
#include "layout/row_convert_kernels.h"

#define KVSHARE_AVX2 __attribute__((target("avx2,f16c,fma")))

namespace kvshare::layout::kernels {
namespace {

// 8 floats -> 8 halves, bit-identical with fp32_to_fp16 (half.h). vcvtps2ph rounds to
// nearest even like the scalar code but keeps NaN payload bits; ggml's scalar code makes
// every NaN sign | 0x7E00, so NaN lanes are patched.
KVSHARE_AVX2 inline __m128i fp32x8_to_fp16x8(__m256 x) {
  const __m128i half = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 nan_mask = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  if (_mm256_testz_ps(nan_mask, nan_mask)) return half;
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i quiet = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x8000)),
                                        _mm256_set1_epi32(0x7E00));
  const __m128i quiet16 = _mm_packus_epi32(_mm256_castsi256_si128(quiet), _mm256_extracti128_si256(quiet, 1));
  const __m256i mask32 = _mm256_castps_si256(nan_mask);
  const __m128i mask16 = _mm_packs_epi32(_mm256_castsi256_si128(mask32), _mm256_extracti128_si256(mask32, 1));
  return _mm_blendv_epi8(half, quiet16, mask16);
}

// roundf (halfway cases away from zero) for 8 lanes: x - trunc(x) is exact in float, so
// comparing it with 0.5 decides the same way roundf does.
KVSHARE_AVX2 inline __m256 round_half_away(__m256 x) {
  const __m256 truncated = _mm256_round_ps(x, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  const __m256 frac = _mm256_andnot_ps(sign_bit, _mm256_sub_ps(x, truncated));
  const __m256 step = _mm256_and_ps(_mm256_cmp_ps(frac, _mm256_set1_ps(0.5f), _CMP_GE_OQ),
                                    _mm256_or_ps(_mm256_and_ps(x, sign_bit), _mm256_set1_ps(1.0f)));
  return _mm256_add_ps(truncated, step);
}

// The low byte of each int32 lane, in order: ggml's `int8_t q = roundf(v)` truncates the
// 32-bit cvttss2si result, it does not saturate, so pack instructions would differ on the
// 0x80000000 that NaN and out-of-range values give.
KVSHARE_AVX2 inline void store_low_bytes(int8_t* dst, __m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  // After the byte shuffle each 128-bit lane holds 4 useful bytes in its first dword.
  const __m256i ab = _mm256_unpacklo_epi32(_mm256_shuffle_epi8(a, pick), _mm256_shuffle_epi8(b, pick));
  const __m256i cd = _mm256_unpacklo_epi32(_mm256_shuffle_epi8(c, pick), _mm256_shuffle_epi8(d, pick));
  // ab dwords: a0 b0 x x | a1 b1 x x ; cd likewise. Combine into a0 b0 c0 d0 | a1 b1 c1 d1.
  const __m256i abcd = _mm256_unpacklo_epi64(ab, cd);
  // abcd dwords: a0 b0 c0 d0 | a1 b1 c1 d1 -> a0 a1 b0 b1 c0 c1 d0 d1.
  const __m256i ordered = _mm256_permutevar8x32_epi32(abcd, order);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), ordered);
}

}  // namespace

KVSHARE_AVX2 void fp32_to_fp16_avx2(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i lo = fp32x8_to_fp16x8(_mm256_loadu_ps(src + i));
    const __m128i hi = fp32x8_to_fp16x8(_mm256_loadu_ps(src + i + 8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_set_m128i(hi, lo));
  }
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), fp32x8_to_fp16x8(_mm256_loadu_ps(src + i)));
  for (; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
}

KVSHARE_AVX2 void fp16_to_fp32_avx2(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = fp16_to_fp32(src[i]);
}

KVSHARE_AVX2 void fp32_to_q8_0_avx2(const float* src, void* dst, int64_t n) {
  auto* blocks = static_cast<blocks::BlockQ8_0*>(dst);
  const int64_t n_blocks = n / blocks::kQK8_0;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t b = 0; b < n_blocks; ++b) {
    const float* x = src + b * blocks::kQK8_0;
    __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8), v2 = _mm256_loadu_ps(x + 16),
           v3 = _mm256_loadu_ps(x + 24);
    // A NaN makes the reference's sequential MAX order-dependent; such a block (never in
    // real activations) takes the scalar path so the bytes still agree.
    const __m256 unordered =
        _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(v0, v0, _CMP_UNORD_Q), _mm256_cmp_ps(v1, v1, _CMP_UNORD_Q)),
                     _mm256_or_ps(_mm256_cmp_ps(v2, v2, _CMP_UNORD_Q), _mm256_cmp_ps(v3, v3, _CMP_UNORD_Q)));
    if (!_mm256_testz_ps(unordered, unordered)) {
      fp32_to_q8_0_scalar(x, &blocks[b], blocks::kQK8_0);
      continue;
    }
    __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, abs_mask), _mm256_and_ps(v1, abs_mask)),
                                _mm256_max_ps(_mm256_and_ps(v2, abs_mask), _mm256_and_ps(v3, abs_mask)));
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax_scalar = _mm_cvtss_f32(m4);
    // Same float operations as quantize_row_q8_0_ref: d = amax / 127, id = 1 / d.
    const float d = amax_scalar / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    blocks[b].d = fp32_to_fp16(d);
    const __m256 mul = _mm256_set1_ps(id);
    const __m256i q0 = _mm256_cvttps_epi32(round_half_away(_mm256_mul_ps(v0, mul)));
    const __m256i q1 = _mm256_cvttps_epi32(round_half_away(_mm256_mul_ps(v1, mul)));
    const __m256i q2 = _mm256_cvttps_epi32(round_half_away(_mm256_mul_ps(v2, mul)));
    const __m256i q3 = _mm256_cvttps_epi32(round_half_away(_mm256_mul_ps(v3, mul)));
    store_low_bytes(blocks[b].qs, q0, q1, q2, q3);
  }
}

KVSHARE_AVX2 void copy_bytes_streaming_avx2(void* dst, const void* src, size_t bytes) {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  // Below a few KiB the fence and the alignment head cost more than the cache pollution.
  if (bytes < 4096) {
    std::memcpy(d, s, bytes);
    return;
  }
  const size_t head = (32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31;
  std::memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  size_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
  }
  _mm_sfence();
  std::memcpy(d + i, s + i, bytes - i);
}

KVSHARE_AVX2 void copy_bytes_stream_nofence_avx2(void* dst, const void* src, size_t bytes) {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  const size_t head = std::min(bytes, (32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31);
  std::memcpy(d, s, head);
  size_t i = head;
  for (; i + 64 <= bytes; i += 64) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
  }
  std::memcpy(d + i, s + i, bytes - i);
}

KVSHARE_AVX2 void fp32_to_fp16_stream_nofence_avx2(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  // Scalar up to a 32-byte boundary of the destination, then whole 16-element stores.
  for (; i < n && (reinterpret_cast<uintptr_t>(dst + i) & 31) != 0; ++i) dst[i] = fp32_to_fp16(src[i]);
  for (; i + 16 <= n; i += 16) {
    const __m128i lo = fp32x8_to_fp16x8(_mm256_loadu_ps(src + i));
    const __m128i hi = fp32x8_to_fp16x8(_mm256_loadu_ps(src + i + 8));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_set_m128i(hi, lo));
  }
  for (; i < n; ++i) dst[i] = fp32_to_fp16(src[i]);
}

void store_fence() { _mm_sfence(); }

}  // namespace kvshare::layout::kernels
