// The kvshare-bench group registry. A group registers Google Benchmark cases for one
// subject (state files, the handoff, the scatter, ...) and a report that turns the runs
// of one invocation into the side-by-side ratios the issues ask for.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace kvshare::bench {

struct BenchArgs {
  bool json = false;            // one JSON object per case on stdout, nothing else
  bool smoke = false;           // tiny sizes and one iteration: proves the code runs
  std::vector<int> tokens;      // --tokens 307,4096; empty = the group's defaults
  std::vector<std::string> rest;  // flags for the group (after --)
};

// One finished benchmark case, as the reporter saw it.
struct RunResult {
  std::string name;                       // "statefile/write/4096"
  double seconds_per_iteration = 0;       // wall time
  long long iterations = 0;
  std::map<std::string, double> counters;  // user counters, already finalised (rates per second)
};

struct Group {
  std::string name;
  std::string help;
  // Registers the cases (benchmark::RegisterBenchmark); called once before the run.
  std::function<void(const BenchArgs&)> register_benchmarks;
  // Prints the table (or JSON lines) from this run's results. Returns the exit code.
  std::function<int(const std::vector<RunResult>&, const BenchArgs&)> report;
};

// Adds a group; used from a static initialiser in each <group>_bench.cc:
//   static const bool registered = kvshare::bench::add_group({...});
bool add_group(Group group);

// Finds runs whose name starts with `prefix`, in run order.
std::vector<const RunResult*> runs_with_prefix(const std::vector<RunResult>& runs, const std::string& prefix);

// Median over runs named exactly `name` (repetitions), 0 when there is none.
double median_seconds(const std::vector<RunResult>& runs, const std::string& name);

}  // namespace kvshare::bench
