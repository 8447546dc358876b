// The provider server's run of a provider command (the NPU engine's, or kvshare-prefill in
// its place) on the file route's contract: the one place that writes the ids file and
// builds the argv, for both of its endpoints (/prefill and /prefill-state).
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>

#include "layout/error.h"
#include "layout/kv_params.h"

namespace kvshare::refmodel {

// Writes `ids` to DIR/prompt.ids and runs
//   COMMAND --tokens IDS --out STATE --model MODEL --ctx-size N --flash-attn on|off
//           --cache-type-k T --cache-type-v T [--parallel N [--kv-unified]]
// (the last two only when `params` has several sequences), with ONEBIT_HYBRID_STATE_VERSION
// set to `state_version` when it is not 0, for at most `timeout` (then its process group is
// killed). Its stderr goes to ours. Returns the command's own prefill time in ms; EIO naming
// the command and how it ended.
Result<double> run_provider_command(const std::string& command, const std::filesystem::path& dir,
                                    const std::filesystem::path& state_path, const std::string& model_path,
                                    const layout::KvParams& params, uint32_t state_version,
                                    std::span<const int32_t> ids, std::chrono::milliseconds timeout);

}  // namespace kvshare::refmodel
