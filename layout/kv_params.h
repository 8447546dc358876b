// The KV parameters llama-server takes (-c, -np, -kvu, -ctk, -ctv, -fa, --swa-full, -ub).
// Both sides of a share must use the same ones; they travel in the layout header.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

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

// llama-server's defaults for -fa, -ctk and -ctv as typed (common/common.h): every tool
// that takes the flags starts from these, so a flag left out means what llama-server does.
inline constexpr std::string_view kDefaultFlashAttn = "auto";
inline constexpr std::string_view kDefaultCacheType = "f16";

// -fa VALUE as llama-server reads it (common/arg.cpp: is_truthy, is_falsey, is_autoy):
// on|enabled|true|1 and off|disabled|false|0, and auto|-1, which is on: a CPU llama-server
// resolves auto to on, and the CPU is the decoder this repository runs. True when flash
// attention is on (V not transposed). EINVAL naming -fa, the value and the accepted values.
Result<bool> parse_flash_attn(std::string_view value);

// A -ctk/-ctv VALUE (`flag` names which in the error): parse_cache_type's types.
Result<GgmlType> parse_cache_type_flag(std::string_view flag, std::string_view value);

// -fa, -ctk and -ctv as typed, set on `params`; the first bad one fails, naming its flag.
// Checks each value only: validate() checks the combination.
Result<KvParams> apply_kv_flags(KvParams params, std::string_view flash_attn, std::string_view cache_type_k,
                                std::string_view cache_type_v);

// Checks combinations llama.cpp refuses: quantized V without flash attention,
// n_seq_max 0. Errors name the flag.
Result<void> validate(const KvParams& params);

// "-c 8192 -np 1 -ctk f16 -ctv f16 -fa on" (what a human compares between two sides).
std::string describe(const KvParams& params);

}  // namespace kvshare::layout
