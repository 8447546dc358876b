// The KV parameters llama-server takes (-c, -np, -kvu, -ctk, -ctv, -fa, --swa-full, -ub).
// Both sides of a share must use the same ones; they travel in the layout header.
#pragma once

#include <cstdint>
#include <string>

#include "layout/error.h"
#include "layout/tensor_type.h"

namespace kvshare::layout {

struct KvParams {
  uint32_t n_ctx = 4096;   // -c, every stream's cells (split per sequence unless kv_unified); 0: context_length
  uint32_t n_seq_max = 1;  // -np
  bool kv_unified = true;  // -kvu; a single sequence is always unified
  GgmlType type_k = GgmlType::F16;  // -ctk
  GgmlType type_v = GgmlType::F16;  // -ctv
  bool flash_attn = true;           // -fa on|auto: V not transposed; -fa off: v_trans
  bool swa_full = false;            // --swa-full
  uint32_t n_ubatch = 512;          // -ub: sizes the SWA cache

  bool v_trans() const { return !flash_attn; }
  friend bool operator==(const KvParams&, const KvParams&) = default;
};

// Checks combinations llama.cpp refuses: quantized V without flash attention,
// n_seq_max 0. Errors name the flag.
Result<void> validate(const KvParams& params);

// "-c 8192 -np 1 -ctk f16 -ctv f16 -fa on" (what a human compares between two sides).
std::string describe(const KvParams& params);

}  // namespace kvshare::layout
