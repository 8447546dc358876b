// The split ceiling: what splitting one prompt's GEMM rows between the iGPU and the NPU
// could be worth, from their measured rates (seed page "hybrid-route", the split-prefill
// section). Concurrent: both engines start together on disjoint row ranges and the best
// split makes them finish together. Sequential (the file route): the provider runs first,
// then the decoder, so the cost is additive and the optimum is all-or-nothing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "layout/error.h"

namespace kvshare::xdna {

struct SplitRates {
  double igpu_ms_per_row = 0;      // g: the iGPU (decoder) per GEMM row
  double npu_ms_per_256_rows = 0;  // t: one NPU tile per 256 rows
  uint32_t npu_tiles = 1;          // tiles working in parallel
  // One NPU row with every tile busy: t / 256 / tiles.
  double npu_ms_per_row() const { return npu_ms_per_256_rows / 256.0 / npu_tiles; }
};

struct ConcurrentSplit {
  uint64_t rows = 0;         // M
  uint64_t npu_rows = 0;     // m, integer, the better of the two around the real optimum
  uint64_t igpu_rows = 0;    // M - m
  double igpu_alone_ms = 0;  // g * M
  double split_ms = 0;       // max(g (M - m), m t / 256 / tiles)
  double speedup = 0;        // igpu_alone_ms / split_ms (the split GEMMs only)
};

struct SequentialSplit {
  uint64_t provider_rows = 0;  // 0 whenever the provider's per-row cost exceeds the decoder's
  double ms = 0;
  double decoder_alone_ms = 0;
};

// Checks the rates (positive, tiles >= 1) and rows (>= 1); errors name the flag.
Result<void> validate_rates(const SplitRates& rates, uint64_t rows);

Result<ConcurrentSplit> best_concurrent_split(const SplitRates& rates, uint64_t rows);
Result<SequentialSplit> best_sequential_split(const SplitRates& rates, uint64_t rows);

// End-to-end prefill factor when only a `gemm_share` fraction of prefill time is split:
// 1 / ((1 - S) + S / speedup). Fails on S outside [0, 1] or speedup <= 0.
Result<double> end_to_end_factor(double speedup, double gemm_share);

// The report kvshare-split-ceiling prints: the concurrent split (when rates are given),
// the sequential case, and the end-to-end factor for each share.
struct SplitCeilingRequest {
  bool has_rates = false;
  SplitRates rates;
  uint64_t rows = 0;
  double speedup = 0;               // used when !has_rates
  std::vector<double> gemm_shares;  // fractions
};
Result<std::string> split_ceiling_report(const SplitCeilingRequest& request);

}  // namespace kvshare::xdna
