#include "apps/provider/provider_command.h"

#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <vector>

#include "kvshare/env.h"
#include "layout/tensor_type.h"
#include "route/provider_run.h"

namespace kvshare::refmodel {

Result<double> run_provider_command(const std::string& command, const std::filesystem::path& dir,
                                    const std::filesystem::path& state_path, const std::string& model_path,
                                    const layout::KvParams& params, uint32_t state_version,
                                    std::span<const int32_t> ids, std::chrono::milliseconds timeout) {
  const std::filesystem::path ids_path = dir / "prompt.ids";
  {
    std::ofstream out(ids_path);
    for (int32_t id : ids) out << id << '\n';
    if (!out) return fail(EIO, "writing the ids file {}", ids_path.string());
  }
  std::vector<std::string> argv = {command,
                                   "--tokens",
                                   ids_path.string(),
                                   "--out",
                                   state_path.string(),
                                   "--model",
                                   model_path,
                                   "--ctx-size",
                                   std::to_string(params.n_ctx),
                                   "--flash-attn",
                                   params.flash_attn ? "on" : "off",
                                   "--cache-type-k",
                                   std::string(layout::ggml_type_name(params.type_k)),
                                   "--cache-type-v",
                                   std::string(layout::ggml_type_name(params.type_v))};
  if (params.n_seq_max > 1) {
    argv.insert(argv.end(), {"--parallel", std::to_string(params.n_seq_max)});
    if (params.kv_unified) argv.push_back("--kv-unified");
  }
  std::vector<std::string> env;
  if (state_version != 0) env.push_back(fmt::format("{}={}", kStateVersionEnv, state_version));
  const route::ProviderRun run = route::run_provider(argv, {}, timeout, std::move(env));
  if (!run.err.empty()) std::fprintf(stderr, "%s", run.err.c_str());
  if (!run.ok()) return fail(EIO, "the provider command {} {}", command, run.describe());
  return run.prefill_ms();
}

}  // namespace kvshare::refmodel
