// llama-server's KV flags, declared once for every tool: -c, -fa, -ctk, -ctv and -ub with
// llama-server's defaults and one help text each (the tools rewrite -fa, -ctk, ... to
// their long names first: layout/llama_flags.h).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "layout/error.h"
#include "layout/kv_params.h"

namespace kvshare::tools {

// The flags' values as typed; turned into layout::KvParams after parsing.
struct KvFlags {
  uint32_t n_ctx = 4096;  // -c; a tool whose default is the model's context sets 0 before adding
  std::string flash_attn{layout::kDefaultFlashAttn};    // -fa
  std::string cache_type_k{layout::kDefaultCacheType};  // -ctk
  std::string cache_type_v{layout::kDefaultCacheType};  // -ctv
  uint32_t n_ubatch = 512;                              // -ub
};

// Which of the size flags a tool takes besides -fa, -ctk and -ctv.
struct KvFlagSet {
  bool ctx_size = true;
  bool ubatch_size = false;
};

// The options added, for count() and excludes(); the absent ones are null.
struct KvFlagOptions {
  CLI::Option* ctx_size = nullptr;
  CLI::Option* flash_attn = nullptr;
  CLI::Option* cache_type_k = nullptr;
  CLI::Option* cache_type_v = nullptr;
  CLI::Option* ubatch_size = nullptr;

  std::vector<CLI::Option*> all() const;
  // How many of the flags the command line gave.
  size_t given() const;
};

// Adds the flags to `app`, bound to `flags` (which must outlive the parse).
KvFlagOptions add_kv_flags(CLI::App* app, KvFlags& flags, KvFlagSet set = {});

// `base` with -c, -fa, -ctk, -ctv and -ub from `flags` (-c and -ub only when `set` has them).
// EINVAL naming the flag, the value and the accepted values; the combination is
// layout::validate's to check.
Result<layout::KvParams> to_kv_params(const KvFlags& flags, layout::KvParams base = {}, KvFlagSet set = {});

}  // namespace kvshare::tools
