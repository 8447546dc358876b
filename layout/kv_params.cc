#include "layout/kv_params.h"

#include <cerrno>

#include <fmt/format.h>

namespace kvshare::layout {
namespace {

// LLAMA_MAX_SEQ (src/llama-cparams.h): llama_init_from_model refuses more sequences.
constexpr uint32_t kMaxSequences = 256;

Result<void> check_cache_type(GgmlType type, std::string_view flag) {
  auto parsed = parse_cache_type(ggml_type_name(type));
  if (!parsed) return fail(parsed.error().with_context(flag));
  return {};
}

}  // namespace

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
