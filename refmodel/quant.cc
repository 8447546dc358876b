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

constexpr int kQK = 32;    // QK4_0, QK8_0
constexpr int kQKK = 256;  // QK_K

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
  // layout's decoders are the ones the cache and the state files use (F16C for f16).
  layout::dequantize_row(type, src, dst, n);
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
