// kvshare-split-ceiling: the best concurrent split of a prompt's GEMM rows between the
// iGPU and the NPU tiles, its speed-up, the sequential (file-route) optimum, and the
// end-to-end prefill factor for each --gemm-share. Exit codes: 0 ok, 1 failed, 2 bad usage.
#include <CLI/CLI.hpp>

#include <cstdio>

#include "xdna/split_ceiling.h"

int main(int argc, char** argv) {
  CLI::App app{"Split ceiling: what an iGPU + NPU split of the prefill GEMMs could be worth"};
  kvshare::xdna::SplitCeilingRequest request;
  double g = 0, t = 0, speedup = 0;
  uint32_t tiles = 1;
  uint64_t rows = 0;
  auto* g_opt = app.add_option("--igpu-ms-per-row", g, "iGPU time per GEMM row, ms");
  auto* t_opt = app.add_option("--npu-ms-per-256", t, "one NPU tile's time per 256 rows, ms");
  app.add_option("--tiles", tiles, "NPU tiles working in parallel")->default_val(1);
  auto* rows_opt = app.add_option("--rows", rows, "rows M of the prompt");
  auto* speedup_opt = app.add_option("--speedup", speedup, "a known split GEMM speed-up (skips the rates)");
  app.add_option("--gemm-share", request.gemm_shares, "fraction of prefill time in the split GEMMs (repeatable)");
  speedup_opt->excludes(g_opt)->excludes(t_opt);
  CLI11_PARSE(app, argc, argv);

  request.has_rates = speedup_opt->count() == 0;
  if (request.has_rates && (g_opt->count() == 0 || t_opt->count() == 0 || rows_opt->count() == 0)) {
    std::fprintf(stderr, "kvshare-split-ceiling: give --igpu-ms-per-row, --npu-ms-per-256 and --rows, or --speedup\n");
    return 2;
  }
  request.rates = {g, t, tiles};
  request.rows = rows;
  request.speedup = speedup;
  auto report = kvshare::xdna::split_ceiling_report(request);
  if (!report) {
    std::fprintf(stderr, "kvshare-split-ceiling: %s\n", report.error().what().c_str());
    return 1;
  }
  std::fputs(report->c_str(), stdout);
  return 0;
}
