// kvshare-prefill: the reference prefill provider (docs/refmodel.md).
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <climits>
#include <filesystem>
#include <string>
#include <vector>

#include "apps/provider/prefill_provider.h"
#include "apps/provider/resident_provider.h"
#include "kvshare/env.h"
#include "kvshare/share/provider_share.h"
#include "layout/llama_flags.h"
#include "layout/state_format.h"
#include "refmodel/blas_kernels.h"
#include "tools/cli/kv_flags.h"

int main(int argc, char** argv) {
  kvshare::refmodel::reexec_with_best_blas_kernels(argv);  // before any work: it may exec
  CLI::App app{
      "The reference prefill provider: computes a prompt's KV cache on the CPU and writes a llama.cpp "
      "sequence-state file (--out) or scatters it into a decoder's shared region (--layout/--fds). "
      "Prints {\"prefill_ms\": X, \"n_prefilled\": N} as its last line (N: ids computed and written "
      "here). With --serve PATH or --serve-fd N it stays up instead: the model loaded once, it takes "
      "kvshare-serve's region and prefill requests (docs/provider.md, \"The resident provider\") until "
      "serve closes the channel (--serve-fd) or SIGINT/SIGTERM (--serve)."};
  kvshare::refmodel::PrefillRequest r;
  std::string fds;
  auto* tokens = app.add_option("--tokens", r.tokens_path,
                                "ids file: one decimal id per line, or a JSON array (required, "
                                "except with --serve/--serve-fd)");
  app.add_option("--model", r.model_path, "GGUF model")->required();
  auto* out = app.add_option("--out", r.out_path, "state file to write (file route)");
  app.add_option("--elfs", r.elfs_dir,
                 "NPU kernel directory: accepted for the provider contract and ignored (this reference provider "
                 "computes on the CPU and runs no NPU kernel)");
  kvshare::tools::KvFlags kv;
  kv.n_ctx = r.params.n_ctx;
  const kvshare::tools::KvFlagOptions kv_options = kvshare::tools::add_kv_flags(&app, kv);
  auto* parallel = app.add_option("--np,--parallel", r.params.n_seq_max,
                                  "the decoder's slots, as llama-server's -np (file route: the state file carries one "
                                  "KV stream per slot, as the decoder's cache has, unless --kv-unified)")
                       ->check(CLI::Range(1u, 256u))
                       ->capture_default_str();
  bool kv_unified = false;
  auto* unified = app.add_flag("--kvu,--kv-unified", kv_unified,
                               "the decoder runs --kv-unified: one KV stream for every slot (file route)");
  auto* layout = app.add_option("--layout", r.layout_path, "layout header file (shared route)");
  auto* fd_list = app.add_option("--fds", fds, "inherited region descriptors n[,n...] in chunk order (shared route)");
  uint32_t n_cached = 0;
  auto* cached = app.add_option("--cached", n_cached,
                                "shared route only: the region's cells 0..P-1 already hold the first P ids as "
                                "positions 0..P-1 (the decoder kept them); compute ids P.. attending over them and "
                                "write cells P.. only. 0 <= P < the number of ids; 0 is the same as none");
  uint32_t stream = 0;
  auto* stream_opt = app.add_option("--stream", stream,
                                    "shared route only: the decoder's KV stream to write (slot S of llama-server -np N "
                                    "without --kv-unified); below the layout header's n_stream; default 0");
  uint32_t first_cell = 0, n_cells = 0;
  auto* first_cell_opt = app.add_option("--first-cell", first_cell,
                                        "shared route only: the first cell of the share's run of cells (a unified KV "
                                        "cache of several slots: the cells the decoder reserved for the sequence); "
                                        "id p is written at cell C + p; default 0");
  auto* cells_opt = app.add_option("--cells", n_cells,
                                   "shared route only: the share's number of cells from --first-cell; the ids must fit "
                                   "(default: to the end of the stream)");
  app.add_option("-t,--threads", r.n_threads, "threads (0: all cores)")->capture_default_str();
  uint32_t state_version = 0;
  auto* version =
      app.add_option("--state-version", state_version,
                     "state-file version to write (file route): 2 (llama-server d32676d) or 3 (current); default: "
                     "ONEBIT_HYBRID_STATE_VERSION, which kvshare-serve sets to the decoder's, else 3")
          ->check(CLI::IsMember({2u, 3u}));
  kvshare::refmodel::ResidentOptions resident;
  auto* serve = app.add_option("--serve", resident.socket_path,
                               "resident: listen at this absolute socket path (its directory 0700, ours) and serve "
                               "each kvshare-serve that connects (--prefill-provider-socket), one at a time");
  auto* serve_fd = app.add_option("--serve-fd", resident.serve_fd,
                                  "resident: serve the kvshare-serve that started us on this inherited socket until it "
                                  "closes it")
                       ->check(CLI::Range(3, INT_MAX));
  serve->excludes(serve_fd);
  // A resident provider takes the ids, the region, the stream and the KV params from each request.
  std::vector<CLI::Option*> per_request = kv_options.all();
  per_request.insert(per_request.end(), {tokens, out, layout, fd_list, cached, stream_opt, first_cell_opt, cells_opt,
                                         version, parallel, unified});
  for (auto* option : per_request) {
    serve->excludes(option);
    serve_fd->excludes(option);
  }
  // llama-server's spellings (-ctk, -fa, -np, ...) read as they do for llama-server.
  std::vector<std::string> args = kvshare::layout::normalize_llama_flags({argv, argv + argc});
  std::vector<char*> argv2;
  for (auto& a : args) argv2.push_back(a.data());
  try {
    app.parse(static_cast<int>(argv2.size()), argv2.data());
  } catch (const CLI::ParseError& e) {
    // Every bad usage is 2, an unknown flag included: kvshare-serve tells a provider that
    // predates --cached by that status.
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (serve->count() > 0 || serve_fd->count() > 0) {
    if (serve->count() > 0 && !resident.socket_path.is_absolute()) {
      fmt::print(stderr, "kvshare-prefill: --serve {}: expected an absolute socket path in a 0700 directory of ours\n",
                 resident.socket_path.string());
      return 2;
    }
    resident.model_path = r.model_path;
    resident.n_threads = r.n_threads;
    resident.elfs_dir = r.elfs_dir;
    return kvshare::refmodel::run_resident_provider(resident);
  }
  if (tokens->count() == 0) {
    fmt::print(stderr,
               "kvshare-prefill: --tokens is required (or --serve PATH / --serve-fd N for the resident form)\n"
               "Run with --help for more information.\n");
    return 2;
  }
  if (cached->count() > 0) r.n_cached = n_cached;
  if (stream_opt->count() > 0) r.stream = stream;
  if (first_cell_opt->count() > 0) r.first_cell = first_cell;
  if (cells_opt->count() > 0) r.n_cells = n_cells;

  auto params = kvshare::tools::to_kv_params(kv, r.params);
  if (!params) {
    fmt::print(stderr, "kvshare-prefill: {}\n", params.error().what());
    return 2;
  }
  r.params = *params;
  // llama-server's rule: one sequence is always unified; several are not unless -kvu.
  r.params.kv_unified = r.params.n_seq_max == 1 || kv_unified;
  if ((parallel->count() > 0 || unified->count() > 0) && out->count() == 0) {
    fmt::print(stderr,
               "kvshare-prefill: -np/--kv-unified describe the decoder's cache for the state file (--out); "
               "on the shared route the layout header says it\n");
    return 2;
  }
  if (state_version == 0) {
    auto from_env = kvshare::state_version_from_env();
    if (!from_env) {
      fmt::print(stderr, "kvshare-prefill: {}\n", from_env.error().what());
      return 2;
    }
    state_version = from_env->value_or(kvshare::layout::kStateSeqVersionLatest);
  }
  r.state_version = state_version;
  if (!fds.empty()) {
    auto list = kvshare::parse_fd_list(fds);
    if (!list) {
      fmt::print(stderr, "kvshare-prefill: {}\n", list.error().what());
      return 2;
    }
    r.fds = *list;
  }
  if (auto usage = kvshare::refmodel::check_prefill_usage(r); !usage) {
    fmt::print(stderr, "kvshare-prefill: {}\n", usage.error().what());
    return 2;
  }
  auto report = kvshare::refmodel::run_prefill(r);
  if (!report) {
    fmt::print(stderr, "kvshare-prefill: {}\n", report.error().what());
    return 1;
  }
  fmt::print(stderr, "kvshare-prefill: {} route, {} tokens ({} prefilled): forward {:.3f} ms, write {:.3f} ms\n",
             report->route, report->n_tokens, report->n_prefilled, report->forward_ms, report->write_ms);
  fmt::print("{{\"prefill_ms\": {:.3f}, \"n_prefilled\": {}}}\n", report->prefill_ms, report->n_prefilled);
  return 0;
}
