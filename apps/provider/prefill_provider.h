// The reference provider (kvshare-prefill): the provider contract of docs/provider.md on the CPU
// reference transformer, both forms.
//   file route:   --tokens IDS --out STATE --model M [--elfs DIR] [-c N -ctk T -ctv T -fa on|off]
//                 computes the prompt's K/V and streams a llama.cpp sequence-state file
//                 (statefile::StateFileWriter) that /slots/0?action=restore loads.
//   shared route: --tokens IDS --model M --layout HEADER --fds n[,n...]
//                 imports the decoder's regions (inherited fds), checks the layout header
//                 against the model, and scatters the rows into the region
//                 (kvshare::scatter), where the decoder adopts them with no copy.
//                 With --stream S it writes stream S's cells only (slot S of -np N).
//                 With --cached P the region's cells 0..P-1 already hold the first P ids
//                 (the decoder kept them): a Context over the region itself attends over
//                 them and writes cells P.. only.
// The model load and both routes are prefill_routes.h, which the resident form
// (resident_provider.h) shares. docs/refmodel.md documents the ids file and every refusal.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "apps/provider/prefill_routes.h"
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
  layout::KvParams params;                                  // -c -ctk -ctv -fa, mirroring llama-server's flags
  uint32_t state_version = layout::kStateSeqVersionLatest;  // the decoder's LLAMA_STATE_SEQ_VERSION
  std::string elfs_dir;  // accepted for the contract and ignored: the CPU runs no NPU kernels
  // Shared route (when layout_path is set).
  std::string layout_path;
  std::vector<int> fds;  // inherited descriptors, one per chunk, in layout order (parsed by
                         // kvshare::parse_fd_list: >= 3, distinct, at most SCM_MAX_FD); taken
  // --cached P (shared route only): the region's cells 0..P-1 hold the first P ids as
  // positions 0..P-1, in the decoder's cache types; 0 <= P < the number of ids. Unset
  // and 0 are the same on the shared route; set at all on the file route is refused.
  std::optional<uint32_t> n_cached;
  // --stream S (shared route only): the KV stream (the decoder's slot, -np N without
  // --kv-unified) whose cells are written; below the header's n_stream. Unset and 0 are
  // the same on the shared route; set at all on the file route is refused.
  std::optional<uint32_t> stream;
  // --first-cell C --cells N (shared route only): the share's run of cells of the stream
  // (a unified cache of several slots): id p is written at cell C + p, p < N. Unset: no
  // range, cells 0.. as before. Set at all on the file route is refused.
  std::optional<uint32_t> first_cell;
  std::optional<uint32_t> n_cells;
  int n_threads = 0;  // 0: all cores
};

// The refusals that are the caller's usage, not a failed prefill (kvshare-prefill exits 2
// for them): --cached, --stream, --first-cell or --cells on the file route, --cached not below the number of ids,
// --stream past the layout header's n_stream. Reads the
// ids file for the latter; an ids file that cannot be read or parsed is left to
// run_prefill, which names what is wrong with it.
Result<void> check_prefill_usage(const PrefillRequest& request);

// Runs one prefill. Every failure is an Error naming the file, flag, id or field; on the
// file route no partial file is left behind. Takes ownership of request.fds (closed
// before returning, success or not).
Result<PrefillReport> run_prefill(const PrefillRequest& request);

}  // namespace kvshare::refmodel
