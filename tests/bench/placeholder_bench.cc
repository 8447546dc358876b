// A baseline group every later group compares against: memcpy bandwidth on this machine.
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <cstring>
#include <vector>

#include "bench_registry.h"

namespace kvshare::bench {
namespace {

void bm_memcpy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<char> src(bytes, 1), dst(bytes);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.counters["gbps"] = benchmark::Counter(
      static_cast<double>(bytes) * static_cast<double>(state.iterations()) / 1e9, benchmark::Counter::kIsRate);
}

const bool registered = add_group({
    "memcpy",
    "memcpy bandwidth of this machine (the baseline every ratio is taken against)",
    [](const BenchArgs& args) {
      benchmark::RegisterBenchmark("memcpy/bytes", bm_memcpy)->Arg(args.smoke ? (1 << 16) : (64 << 20));
    },
    [](const std::vector<RunResult>& runs, const BenchArgs& args) {
      for (const RunResult* run : runs_with_prefix(runs, "memcpy/")) {
        const double gbps = run->counters.count("gbps") ? run->counters.at("gbps") : 0.0;
        if (args.json)
          fmt::print("{{\"bench\":\"memcpy\",\"gbps\":{:.3f}}}\n", gbps);
        else
          fmt::print("memcpy: {:.2f} GB/s\n", gbps);
      }
      return 0;
    },
});

}  // namespace
}  // namespace kvshare::bench
