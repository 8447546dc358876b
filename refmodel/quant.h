// Weight and cache element codecs of the reference transformer: ggml's dequantize_row_*
// for the weight types refmodel loads, and the f32 -> cache-type conversions it stores
// KV with. One seam: everything that turns ggml blocks into floats or back goes through
// here, so the forward pass never sees a block layout.
#pragma once

#include <cstdint>
#include <span>

#include "layout/error.h"
#include "layout/tensor_type.h"

namespace kvshare::refmodel {

// Weight types Model::from_gguf accepts: f32, f16, bf16, q8_0, q4_0, q4_K, q6_K.
bool is_supported_weight_type(layout::GgmlType type);

// Decodes `n` elements of `type` from `src` into `dst` exactly as ggml's
// dequantize_row_* (and ggml_fp16_to_fp32 / ggml_bf16_to_fp32) do. `n` must be a multiple
// of the block size; fails naming the type when it is not a supported weight type.
Result<void> dequantize_weights(layout::GgmlType type, const void* src, float* dst, int64_t n);

// Types a Context keeps its KV cache in: f32, f16, bf16, q8_0, q4_0 (and every other type
// layout::convert_row encodes).
bool is_supported_cache_type(layout::GgmlType type);

// Converts one cache row: optionally rotates each group of `rotation_group` elements by
// the orthonormal Walsh–Hadamard matrix (llama.cpp's attn_rot_k / attn_rot_v), then
// encodes as `type` (ggml's quantize_row_*_ref / fp32_to_fp16 rounding). `src` is not
// modified.
void store_cache_row(layout::GgmlType type, const float* src, void* dst, int64_t n, int rotation_group);

// In place: multiplies each consecutive group of `group` floats (a power of two) by the
// orthonormal Walsh–Hadamard matrix in Sylvester order, ggml_gen_hadamard's matrix
// (llama-kv-cache.cpp). The matrix is symmetric and its own inverse.
void hadamard_groups(float* data, int64_t n, int group);

// The rotation group llama.cpp applies to a cache of `cache_type` for heads of
// `n_embd_head` elements (llama_kv_cache::build_input_k_rot / build_input_v_rot), 0 for
// none. K: quantized type, head a multiple of 64 -> the largest power of two >= 64
// dividing the head. V: quantized, head a multiple of 64 -> 64. LLAMA_ATTN_ROT_DISABLE
// is not consulted: the provider and decoder of a share must agree, so it is a parameter.
int cache_rotation_group(bool is_k, layout::GgmlType cache_type, uint32_t n_embd_head, bool rotation_disabled = false);

// Decodes one cache row back to f32 (no un-rotation: attention works in the rotated basis).
void load_cache_row(layout::GgmlType type, const void* src, float* dst, int64_t n);

// Quantize-dequantize `n` activations in place the way ggml-cpu prepares the right-hand
// side of a matrix product with weights of `weight_type` (its vec_dot_type: f16 for f16
// weights, q8_0 for q8_0/q4_0, q8_K for k-quants, bf16 for bf16, none for f32), so that a
// float GEMM over dequantized weights sees the same operand values llama.cpp's CPU
// kernels multiply.
void round_like_vec_dot(layout::GgmlType weight_type, float* data, int64_t n);

}  // namespace kvshare::refmodel
