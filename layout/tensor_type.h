// ggml's tensor types as they appear in GGUF files, state files and cache tensors:
// ids, block geometry and row sizes. Mirrors ggml/src/ggml.c type_traits.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "layout/error.h"

namespace kvshare::layout {

// The numeric ids are ggml's `enum ggml_type` and are written to files: never renumber.
enum class GgmlType : int32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  IQ2_XXS = 16,
  IQ2_XS = 17,
  IQ3_XXS = 18,
  IQ1_S = 19,
  IQ4_NL = 20,
  IQ3_S = 21,
  IQ2_S = 22,
  IQ4_XS = 23,
  I8 = 24,
  I16 = 25,
  I32 = 26,
  I64 = 27,
  F64 = 28,
  IQ1_M = 29,
  BF16 = 30,
  TQ1_0 = 34,
  TQ2_0 = 35,
  MXFP4 = 39,
};

struct GgmlTypeTraits {
  std::string_view name;  // ggml's name: "f16", "q8_0", "bf16"
  int64_t block_size;     // elements per block
  int64_t type_size;      // bytes per block
};

// Traits of a known type id, or nullopt for an id ggml does not define (removed ids
// such as 4, 5, 31-33 included).
std::optional<GgmlTypeTraits> ggml_type_traits(int32_t type_id);
// Traits of a valid enum value (the enum only holds known ids).
GgmlTypeTraits ggml_traits(GgmlType type);
std::string_view ggml_type_name(GgmlType type);

// ggml_row_size: bytes of `n_elements` of `type`. Precondition: n_elements is a multiple of
// the block size (every caller validates that first; see is_row_aligned).
uint64_t ggml_row_size(GgmlType type, int64_t n_elements);
bool is_row_aligned(GgmlType type, int64_t n_elements);

// Types llama-server accepts for -ctk/-ctv: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1,
// iq4_nl. Anything else is an error naming the allowed list.
Result<GgmlType> parse_cache_type(std::string_view name);
bool is_quantized(GgmlType type);

}  // namespace kvshare::layout
