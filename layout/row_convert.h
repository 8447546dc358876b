// Row conversion between the types a prefill produces (f32, f16, bf16) and the types a
// cache holds (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl), bit-exact with
// ggml's quantize_row_*_ref / ggml_fp32_to_fp16. One implementation, used by the
// scatter (xdna/) and the state-file writer (kvshare/). Vector paths (F16C/AVX2) are
// chosen at run time and give the same bytes as the scalar ones.
#pragma once

#include <cstdint>

#include "layout/memory_shape.h"
#include "layout/tensor_type.h"

namespace kvshare::layout {

// Types a provider may hand rows in.
bool is_source_type(GgmlType type);
// Types convert_row can produce (the cache types).
bool is_cache_type(GgmlType type);

// Converts `n` elements of `src` (src_type) into `dst` (dst_type, ggml_row_size bytes).
// When `rotation_group` > 0, each consecutive group of that many elements is first
// multiplied by the orthonormal Walsh–Hadamard matrix, as llama.cpp does for quantized
// caches (attn_rot_k / attn_rot_v). Preconditions (checked by callers; asserted in
// debug builds): is_source_type(src_type), is_cache_type(dst_type), n a multiple of the
// destination block size and of rotation_group.
void convert_row(GgmlType src_type, const void* src, GgmlType dst_type, void* dst, int64_t n, int rotation_group = 0);

// As convert_row, but may write `dst` with non-temporal stores (same-type copies and
// f32 -> f16 on the AVX2 path): for destinations nobody reads soon, such as a shared
// cache the decoder maps later. The bytes are guaranteed visible to other threads and
// devices only after convert_stream_fence() on the writing thread.
void convert_row_streaming(GgmlType src_type, const void* src, GgmlType dst_type, void* dst, int64_t n,
                           int rotation_group = 0);
void convert_stream_fence();

// Decodes `n` elements of any cache type or weight type (also q4_K, q5_K, q6_K, q8_K)
// into f32, as ggml's dequantize_row_* does. Returns false for a type it cannot decode.
bool dequantize_row(GgmlType type, const void* src, float* dst, int64_t n);

// In place: multiplies each group of `group` floats by the orthonormal Walsh–Hadamard
// matrix (group a power of two). Its own inverse.
void hadamard_rotate(float* data, int64_t n, int group);

// The rotation group llama.cpp applies to a cache tensor, 0 for none:
// K: quantized type and head size a multiple of 64 → the largest power of two >= 64
//    dividing the head size; V: quantized and head size a multiple of 64 → 64.
// `rotation_disabled` mirrors LLAMA_ATTN_ROT_DISABLE (read by the caller, not here).
int kv_rotation_group(TensorKind kind, GgmlType cache_type, uint32_t n_embd_head, bool rotation_disabled);

// Which vector path convert_row uses on this CPU: "avx2+f16c" or "scalar".
const char* convert_backend_name();

}  // namespace kvshare::layout
