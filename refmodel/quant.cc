// Block layouts and arithmetic follow ggml/src/ggml-quants.c (dequantize_row_*,
// quantize_row_*_ref) and ggml-common.h (block_* structs), commit d32676d. The
// expressions keep ggml's evaluation order so the floats come out bit-identical.
#include "refmodel/quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "layout/half.h"
#include "layout/row_convert.h"

namespace kvshare::refmodel {
namespace {

using layout::GgmlType;

constexpr int kQK = 32;     // QK4_0, QK8_0
constexpr int kQKK = 256;   // QK_K

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

float half_at(const uint8_t* p) { return layout::fp16_to_fp32(load_u16(p)); }

// block_q8_0: ggml_half d; int8_t qs[32]  (34 bytes)
void dequantize_q8_0(const uint8_t* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n / kQK; ++i, x += 34) {
    const float d = half_at(x);
    const auto* qs = reinterpret_cast<const int8_t*>(x + 2);
    for (int j = 0; j < kQK; ++j) y[i * kQK + j] = qs[j] * d;
  }
}

// block_q4_0: ggml_half d; uint8_t qs[16]  (18 bytes)
void dequantize_q4_0(const uint8_t* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n / kQK; ++i, x += 18) {
    const float d = half_at(x);
    const uint8_t* qs = x + 2;
    for (int j = 0; j < kQK / 2; ++j) {
      const int x0 = (qs[j] & 0x0F) - 8;
      const int x1 = (qs[j] >> 4) - 8;
      y[i * kQK + j] = x0 * d;
      y[i * kQK + j + kQK / 2] = x1 * d;
    }
  }
}

void get_scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
  }
}

// block_q4_K: ggml_half d; ggml_half dmin; uint8_t scales[12]; uint8_t qs[128]  (144 bytes)
void dequantize_q4_K(const uint8_t* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n / kQKK; ++i, x += 144) {
    const float d = half_at(x);
    const float min = half_at(x + 2);
    const uint8_t* scales = x + 4;
    const uint8_t* q = x + 16;
    int is = 0;
    uint8_t sc, m;
    for (int j = 0; j < kQKK; j += 64) {
      get_scale_min_k4(is + 0, scales, &sc, &m);
      const float d1 = d * sc;
      const float m1 = min * m;
      get_scale_min_k4(is + 1, scales, &sc, &m);
      const float d2 = d * sc;
      const float m2 = min * m;
      for (int l = 0; l < 32; ++l) *y++ = d1 * (q[l] & 0xF) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * (q[l] >> 4) - m2;
      q += 32;
      is += 2;
    }
  }
}

// block_q6_K: uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; ggml_half d  (210 bytes)
void dequantize_q6_K(const uint8_t* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n / kQKK; ++i, x += 210) {
    const float d = half_at(x + 208);
    const uint8_t* ql = x;
    const uint8_t* qh = x + 128;
    const auto* sc = reinterpret_cast<const int8_t*>(x + 192);
    for (int nn = 0; nn < kQKK; nn += 128) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const auto q1 = static_cast<int8_t>(static_cast<int8_t>((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
        const auto q2 = static_cast<int8_t>(static_cast<int8_t>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
        const auto q3 = static_cast<int8_t>(static_cast<int8_t>((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
        const auto q4 = static_cast<int8_t>(static_cast<int8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        y[l + 0] = d * sc[is + 0] * q1;
        y[l + 32] = d * sc[is + 2] * q2;
        y[l + 64] = d * sc[is + 4] * q3;
        y[l + 96] = d * sc[is + 6] * q4;
      }
      y += 128;
      ql += 64;
      qh += 32;
      sc += 8;
    }
  }
}

int nearest_int(float fval) {
  float val = fval + 12582912.f;
  int i;
  std::memcpy(&i, &val, sizeof(int));
  return (i & 0x007fffff) - 0x00400000;
}

// quantize_row_q8_0_ref followed by dequantize_row_q8_0, in place.
void round_q8_0(float* x, int64_t n) {
  for (int64_t i = 0; i < n / kQK; ++i) {
    float* b = x + i * kQK;
    float amax = 0.0f;
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(b[j]));
    const float d = amax / ((1 << 7) - 1);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const float dh = layout::fp16_to_fp32(layout::fp32_to_fp16(d));
    for (int j = 0; j < kQK; ++j) b[j] = static_cast<float>(static_cast<int8_t>(std::roundf(b[j] * id))) * dh;
  }
}

// quantize_row_q8_K_ref followed by dequantize_row_q8_K, in place.
void round_q8_K(float* x, int64_t n) {
  for (int64_t i = 0; i < n / kQKK; ++i) {
    float* b = x + i * kQKK;
    float max = 0, amax = 0;
    for (int j = 0; j < kQKK; ++j) {
      const float ax = std::fabs(b[j]);
      if (ax > amax) {
        amax = ax;
        max = b[j];
      }
    }
    if (amax == 0.0f) {
      std::fill(b, b + kQKK, 0.0f);
      continue;
    }
    const float iscale = -127.f / max;
    const float d = 1 / iscale;
    for (int j = 0; j < kQKK; ++j) b[j] = d * static_cast<float>(std::min(127, nearest_int(iscale * b[j])));
  }
}

}  // namespace

bool is_supported_weight_type(GgmlType type) {
  switch (type) {
    case GgmlType::F32:
    case GgmlType::F16:
    case GgmlType::BF16:
    case GgmlType::Q8_0:
    case GgmlType::Q4_0:
    case GgmlType::Q4_K:
    case GgmlType::Q6_K:
      return true;
    default:
      return false;
  }
}

Result<void> dequantize_weights(GgmlType type, const void* src, float* dst, int64_t n) {
  if (!is_supported_weight_type(type))
    return fail(EINVAL, "weight type {} is not supported (f32, f16, bf16, q8_0, q4_0, q4_K, q6_K are)",
                layout::ggml_type_name(type));
  if (!layout::is_row_aligned(type, n))
    return fail(EINVAL, "{} elements of {} is not a whole number of blocks", n, layout::ggml_type_name(type));
  const auto* x = static_cast<const uint8_t*>(src);
  switch (type) {
    case GgmlType::F32:
      std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      break;
    case GgmlType::F16:
      for (int64_t i = 0; i < n; ++i) dst[i] = layout::fp16_to_fp32(load_u16(x + 2 * i));
      break;
    case GgmlType::BF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = layout::bf16_to_fp32(load_u16(x + 2 * i));
      break;
    case GgmlType::Q8_0: dequantize_q8_0(x, dst, n); break;
    case GgmlType::Q4_0: dequantize_q4_0(x, dst, n); break;
    case GgmlType::Q4_K: dequantize_q4_K(x, dst, n); break;
    case GgmlType::Q6_K: dequantize_q6_K(x, dst, n); break;
    default: break;
  }
  return {};
}

bool is_supported_cache_type(GgmlType type) { return layout::is_cache_type(type); }

void hadamard_groups(float* data, int64_t n, int group) { layout::hadamard_rotate(data, n, group); }

int cache_rotation_group(bool is_k, GgmlType cache_type, uint32_t n_embd_head, bool rotation_disabled) {
  return layout::kv_rotation_group(is_k ? layout::TensorKind::k : layout::TensorKind::v, cache_type, n_embd_head,
                                   rotation_disabled);
}

// The same conversion the scatter and the state-file writer use, so a Context's own
// cache holds exactly the bytes a provider hands the decoder.
void store_cache_row(GgmlType type, const float* src, void* dst, int64_t n, int rotation_group) {
  layout::convert_row(GgmlType::F32, src, type, dst, n, rotation_group);
}

void load_cache_row(GgmlType type, const void* src, float* dst, int64_t n) {
  layout::dequantize_row(type, src, dst, n);
}

void round_like_vec_dot(GgmlType weight_type, float* data, int64_t n) {
  switch (weight_type) {
    case GgmlType::F16:
      for (int64_t i = 0; i < n; ++i) data[i] = layout::fp16_to_fp32(layout::fp32_to_fp16(data[i]));
      break;
    case GgmlType::BF16:
      for (int64_t i = 0; i < n; ++i) data[i] = layout::bf16_to_fp32(layout::fp32_to_bf16(data[i]));
      break;
    case GgmlType::Q8_0:
    case GgmlType::Q4_0:
      round_q8_0(data, n);
      break;
    case GgmlType::Q4_K:
    case GgmlType::Q6_K:
      round_q8_K(data, n);
      break;
    default:
      break;
  }
}

}  // namespace kvshare::refmodel
