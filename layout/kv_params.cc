#include "layout/kv_params.h"

#include <cerrno>

#include <fmt/format.h>

namespace kvshare::layout {
namespace {

// LLAMA_MAX_SEQ (src/llama-cparams.h): llama_init_from_model refuses more sequences.
constexpr uint32_t kMaxSequences = 256;

Result<void> check_cache_type(GgmlType type, std::string_view flag) {
  auto parsed = parse_cache_type_flag(flag, ggml_type_name(type));
  if (!parsed) return fail(parsed.error());
  return {};
}

}  // namespace

Result<bool> parse_flash_attn(std::string_view value) {
  for (std::string_view on : {"on", "enabled", "true", "1", "auto", "-1"})
    if (value == on) return true;
  for (std::string_view off : {"off", "disabled", "false", "0"})
    if (value == off) return false;
  return fail(EINVAL,
              "-fa {}: unknown value for --flash-attn: '{}' (llama-server takes on, off or auto; also "
              "enabled/true/1, disabled/false/0, -1)",
              value, value);
}

Result<GgmlType> parse_cache_type_flag(std::string_view flag, std::string_view value) {
  auto type = parse_cache_type(value);
  if (!type) return fail(type.error().with_context(flag));
  return *type;
}

Result<KvParams> apply_kv_flags(KvParams params, std::string_view flash_attn, std::string_view cache_type_k,
                                std::string_view cache_type_v) {
  auto is_flash_attn = parse_flash_attn(flash_attn);
  if (!is_flash_attn) return fail(is_flash_attn.error());
  auto type_k = parse_cache_type_flag("-ctk", cache_type_k);
  if (!type_k) return fail(type_k.error());
  auto type_v = parse_cache_type_flag("-ctv", cache_type_v);
  if (!type_v) return fail(type_v.error());
  params.flash_attn = *is_flash_attn;
  params.type_k = *type_k;
  params.type_v = *type_v;
  return params;
}

Result<void> validate(const KvParams& params) {
  if (params.n_seq_max == 0) return fail(EINVAL, "-np 0: at least one sequence is needed");
  if (params.n_seq_max > kMaxSequences)
    return fail(EINVAL, "-np {}: llama.cpp allows at most {} sequences", params.n_seq_max, kMaxSequences);
  if (params.n_ubatch == 0) return fail(EINVAL, "-ub 0: the micro-batch must hold at least one token");
  if (auto r = check_cache_type(params.type_k, "-ctk"); !r) return r;
  if (auto r = check_cache_type(params.type_v, "-ctv"); !r) return r;
  // llama_init_from_model: "quantized V cache requires flash_attn to be enabled".
  if (is_quantized(params.type_v) && !params.flash_attn)
    return fail(EINVAL, "-ctv {} with -fa off: llama.cpp needs flash attention for a quantized V cache (use -fa on)",
                ggml_type_name(params.type_v));
  return {};
}

std::string describe(const KvParams& params) {
  std::string out = fmt::format("-c {} -np {}", params.n_ctx, params.n_seq_max);
  if (params.n_seq_max > 1 && params.kv_unified) out += " -kvu";
  out += fmt::format(" -ctk {} -ctv {} -fa {}", ggml_type_name(params.type_k), ggml_type_name(params.type_v),
                     params.flash_attn ? "on" : "off");
  if (params.swa_full) out += " --swa-full";
  if (params.n_ubatch != 512) out += fmt::format(" -ub {}", params.n_ubatch);
  return out;
}

}  // namespace kvshare::layout
