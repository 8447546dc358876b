// llama-server's flag spellings. CLI11 takes one-dash names of one letter only, so every
// tool that reads llama-server's flags (-np, -ctk, -fa, ...) rewrites them to their
// two-dash twins before parsing: one table, so every tool accepts the same spellings.
#pragma once

#include <string>
#include <vector>

namespace kvshare::layout {

// Each of llama-server's one-dash multi-letter flags in `args` (alone, or NAME=VALUE)
// becomes its long name: -np --parallel, -kvu --kv-unified, -ctk --cache-type-k,
// -ctv --cache-type-v, -fa --flash-attn, -ub --ubatch-size, -ngl --n-gpu-layers,
// -dev --device. Nothing after a "--" changes (serve passes those to its decoder as given).
std::vector<std::string> normalize_llama_flags(std::vector<std::string> args);

}  // namespace kvshare::layout
