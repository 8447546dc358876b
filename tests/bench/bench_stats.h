// Order statistics of paired rounds, shared by every kvshare-bench group: the median and
// quartiles a report prints, so a ratio comes with the spread that says how far to trust it.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <string>
#include <vector>

namespace kvshare::bench {

// The q-quantile (0..1) of `values` by nearest rank; 0 for no values.
inline double percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  return values[static_cast<size_t>(q * static_cast<double>(values.size() - 1) + 0.5)];
}

inline double median(const std::vector<double>& values) { return percentile(values, 0.5); }

struct Spread {
  double p25 = 0, median = 0, p75 = 0;
};

inline Spread spread_of(const std::vector<double>& values) {
  return {percentile(values, 0.25), percentile(values, 0.5), percentile(values, 0.75)};
}

// Counters `key` (the median), `key_p25` and `key_p75`.
inline void record_spread(benchmark::State& state, const std::string& key, const std::vector<double>& values) {
  const Spread s = spread_of(values);
  state.counters[key + "_p25"] = s.p25;
  state.counters[key] = s.median;
  state.counters[key + "_p75"] = s.p75;
}

}  // namespace kvshare::bench
