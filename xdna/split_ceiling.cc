#include "xdna/split_ceiling.h"

#include <algorithm>
#include <cerrno>
#include <cmath>

namespace kvshare::xdna {
namespace {

double concurrent_ms(const SplitRates& rates, uint64_t rows, uint64_t npu_rows) {
  return std::max(rates.igpu_ms_per_row * static_cast<double>(rows - npu_rows),
                  rates.npu_ms_per_row() * static_cast<double>(npu_rows));
}

}  // namespace

Result<void> validate_rates(const SplitRates& rates, uint64_t rows) {
  if (!(rates.igpu_ms_per_row > 0) || !std::isfinite(rates.igpu_ms_per_row))
    return fail(EINVAL, "--igpu-ms-per-row {} must be a positive time in ms", rates.igpu_ms_per_row);
  if (!(rates.npu_ms_per_256_rows > 0) || !std::isfinite(rates.npu_ms_per_256_rows))
    return fail(EINVAL, "--npu-ms-per-256 {} must be a positive time in ms", rates.npu_ms_per_256_rows);
  if (rates.npu_tiles == 0) return fail(EINVAL, "--tiles 0: at least one NPU tile is needed");
  if (rows == 0) return fail(EINVAL, "--rows 0: the prompt needs at least one row");
  return {};
}

Result<ConcurrentSplit> best_concurrent_split(const SplitRates& rates, uint64_t rows) {
  if (auto valid = validate_rates(rates, rows); !valid) return fail(valid.error());
  // Equal finish: g (M - m) = r m  =>  m = g M / (g + r), r the all-tiles NPU row cost.
  const double g = rates.igpu_ms_per_row, r = rates.npu_ms_per_row();
  const double ideal = g * static_cast<double>(rows) / (g + r);
  const auto below = static_cast<uint64_t>(std::floor(ideal));
  const uint64_t above = std::min(rows, below + 1);
  ConcurrentSplit split;
  split.rows = rows;
  split.npu_rows = concurrent_ms(rates, rows, below) <= concurrent_ms(rates, rows, above) ? below : above;
  split.igpu_rows = rows - split.npu_rows;
  split.igpu_alone_ms = g * static_cast<double>(rows);
  split.split_ms = concurrent_ms(rates, rows, split.npu_rows);
  split.speedup = split.igpu_alone_ms / split.split_ms;
  return split;
}

Result<SequentialSplit> best_sequential_split(const SplitRates& rates, uint64_t rows) {
  if (auto valid = validate_rates(rates, rows); !valid) return fail(valid.error());
  // provider(m) + decoder(M - m) is linear in m: an end point is optimal, and m = 0 (no
  // provider) wins whenever a provider row costs at least a decoder row.
  const double g = rates.igpu_ms_per_row, r = rates.npu_ms_per_row();
  SequentialSplit split;
  split.decoder_alone_ms = g * static_cast<double>(rows);
  split.provider_rows = r < g ? rows : 0;
  split.ms = r * static_cast<double>(split.provider_rows) + g * static_cast<double>(rows - split.provider_rows);
  return split;
}

Result<double> end_to_end_factor(double speedup, double gemm_share) {
  if (!(gemm_share >= 0 && gemm_share <= 1))
    return fail(EINVAL, "--gemm-share {} is not a fraction in [0, 1] (26.2 % is 0.262)", gemm_share);
  if (!(speedup > 0) || !std::isfinite(speedup)) return fail(EINVAL, "--speedup {} must be positive", speedup);
  return 1.0 / ((1.0 - gemm_share) + gemm_share / speedup);
}

Result<std::string> split_ceiling_report(const SplitCeilingRequest& request) {
  std::string out;
  double speedup = request.speedup;
  if (request.has_rates) {
    auto concurrent = best_concurrent_split(request.rates, request.rows);
    if (!concurrent) return fail(concurrent.error());
    auto sequential = best_sequential_split(request.rates, request.rows);
    if (!sequential) return fail(sequential.error());
    speedup = concurrent->speedup;
    out += fmt::format(
        "rows M = {}; iGPU {:.6g} ms/row; NPU {:.6g} ms per 256 rows per tile x {} tile(s) = {:.6g} ms/row\n",
        request.rows, request.rates.igpu_ms_per_row, request.rates.npu_ms_per_256_rows, request.rates.npu_tiles,
        request.rates.npu_ms_per_row());
    out += fmt::format(
        "concurrent: NPU m = {} rows, iGPU {} rows; {:.3f} ms vs {:.3f} ms iGPU alone; split GEMM speed-up {:.3f}x\n",
        concurrent->npu_rows, concurrent->igpu_rows, concurrent->split_ms, concurrent->igpu_alone_ms,
        concurrent->speedup);
    out += fmt::format("sequential (file route): best m = {} ({:.3f} ms vs {:.3f} ms decoder alone){}\n",
                       sequential->provider_rows, sequential->ms, sequential->decoder_alone_ms,
                       sequential->provider_rows == 0 ? "; a provider row costs more than a decoder row" : "");
  } else {
    if (!(speedup > 0) || !std::isfinite(speedup))
      return fail(EINVAL, "--speedup {} must be positive (or give the rates)", speedup);
    out += fmt::format("split GEMM speed-up {:.3f}x (given)\n", speedup);
  }
  for (double share : request.gemm_shares) {
    auto factor = end_to_end_factor(speedup, share);
    if (!factor) return fail(factor.error());
    out += fmt::format("gemm share {:.1f} %: end-to-end {:.3f}x\n", share * 100.0, *factor);
  }
  return out;
}

}  // namespace kvshare::xdna
