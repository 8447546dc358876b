// The reference provider (kvshare-prefill): the seed's provider contract on the CPU
// reference transformer, both forms.
//   file route:   --tokens IDS --out STATE --model M [--elfs DIR] [-c N -ctk T -ctv T -fa on|off]
//                 computes the prompt's K/V and streams a llama.cpp sequence-state file
//                 (statefile::StateFileWriter) that /slots/0?action=restore loads.
//   shared route: --tokens IDS --model M --layout HEADER --fds n[,n...]
//                 imports the decoder's regions (inherited fds), checks the layout header
//                 against the model, and scatters the rows into the region
//                 (xdna::scatter), where the decoder adopts them with no copy.
// docs/refmodel.md documents the ids file and every refusal.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "layout/error.h"
#include "layout/kv_params.h"
#include "layout/state_format.h"

namespace kvshare::refmodel {

// Parses an ids file: a JSON array of integers, or one decimal id per line (blank lines
// and surrounding spaces ignored). `source` names the file in errors, which give the line
// (or array index) and the offending text. Refuses an empty list, non-numbers, negative
// ids and numbers past int32.
Result<std::vector<int32_t>> parse_token_ids(std::string_view text, std::string_view source);

struct PrefillRequest {
  std::string model_path;
  std::string tokens_path;
  // File route.
  std::string out_path;
  layout::KvParams params;        // -c -ctk -ctv -fa, mirroring llama-server's flags
  uint32_t state_version = layout::kStateSeqVersionLatest;  // the decoder's LLAMA_STATE_SEQ_VERSION
  std::string elfs_dir;           // accepted for the contract; the CPU needs no kernels
  // Shared route (when layout_path is set).
  std::string layout_path;
  std::vector<int> fds;           // inherited descriptors, one per chunk, in layout order; taken
  int n_threads = 0;              // 0: all cores
};

struct PrefillReport {
  uint32_t n_tokens = 0;
  double prefill_ms = 0;          // forward pass + writing/scattering, model load excluded
  double forward_ms = 0;          // the transformer alone
  double write_ms = 0;            // state-file writes and commit, or the scatter
  std::string route;              // "file" or "shared"
};

// Parses "3,4,5" into descriptor numbers (non-negative, no duplicates).
Result<std::vector<int>> parse_fd_list(std::string_view text);

// Runs one prefill. Every failure is an Error naming the file, flag, id or field; on the
// file route no partial file is left behind. Takes ownership of request.fds (closed
// before returning, success or not).
Result<PrefillReport> run_prefill(const PrefillRequest& request);

}  // namespace kvshare::refmodel
