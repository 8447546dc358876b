// The row kernels behind convert_row, exposed so tests can run the scalar and the vector
// version of the same kernel on the same input and compare bytes. Callers outside tests
// use layout/row_convert.h, which picks the kernel for this CPU.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvshare::layout::kernels {

// True when this CPU has AVX2, F16C and FMA (the vector kernels' target attributes).
bool cpu_has_avx2_f16c();

// f32 -> f16 with half.h's rounding (NaN becomes sign | 0x7E00, as ggml's scalar code).
void fp32_to_fp16_scalar(const float* src, uint16_t* dst, int64_t n);
void fp32_to_fp16_avx2(const float* src, uint16_t* dst, int64_t n);

// quantize_row_q8_0_ref: n a multiple of 32.
void fp32_to_q8_0_scalar(const float* src, void* dst, int64_t n);
void fp32_to_q8_0_avx2(const float* src, void* dst, int64_t n);

// f16 -> f32 (exact; F16C's vcvtph2ps and half.h agree on every one of the 65,536 values,
// NaNs included: both quiet a signalling NaN the same way).
void fp16_to_fp32_scalar(const uint16_t* src, float* dst, int64_t n);
void fp16_to_fp32_avx2(const uint16_t* src, float* dst, int64_t n);

// Copies `bytes` bytes. The streaming variant uses non-temporal stores for the aligned
// middle (then an sfence): for destinations nobody reads soon, such as a shared cache
// the decoder maps later. Same bytes either way.
void copy_bytes(void* dst, const void* src, size_t bytes);
void copy_bytes_streaming_avx2(void* dst, const void* src, size_t bytes);

// Non-temporal variants that leave the fence to the caller (one sfence per batch of rows,
// not per row): the bytes are final only after store_fence().
void copy_bytes_stream_nofence_avx2(void* dst, const void* src, size_t bytes);
void fp32_to_fp16_stream_nofence_avx2(const float* src, uint16_t* dst, int64_t n);
void store_fence();

}  // namespace kvshare::layout::kernels
