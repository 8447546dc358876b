// The kvshare-bench group registry. A group registers Google Benchmark cases for one
// subject (state files, the handoff, the scatter, ...) and a report that turns the runs
// of one invocation into the side-by-side ratios the issues ask for.
#pragma once

#include <algorithm>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace kvshare::bench {

struct BenchArgs {
  bool json = false;              // one JSON object per case on stdout, nothing else
  bool smoke = false;             // tiny sizes and one iteration: proves the code runs
  std::vector<int> tokens;        // --tokens 307,4096, else the group's `tokens` (or `smoke_tokens`)
  std::vector<std::string> rest;  // the group's own flags as given: "--rows", "f16", "--buffered"
};

// One finished benchmark case, as the reporter saw it.
struct RunResult {
  std::string name;                  // "statefile/write/4096"
  double seconds_per_iteration = 0;  // wall time
  long long iterations = 0;
  std::map<std::string, double> counters;  // user counters, already finalised (rates per second)
};

// A flag of one group, an option of its kvshare-bench subcommand.
struct GroupFlag {
  std::string name;   // "--rows"
  std::string value;  // "" for a switch; else what follows, "PATH", "N", or choices "f16|f32"; "[,...]" at
                      // the end: a comma list, and the flag may be repeated ("--arch qwen3 --arch gemma3")
  std::string help;   // with its default where it has one: "... (default 9)"
};

struct Group {
  std::string name;
  std::string help;
  // Registers the cases (benchmark::RegisterBenchmark); called once before the run.
  std::function<void(const BenchArgs&)> register_benchmarks;
  // Prints the table (or JSON lines) from this run's results. Returns the exit code.
  std::function<int(const std::vector<RunResult>&, const BenchArgs&)> report;
  // The flags register_benchmarks reads from BenchArgs::rest; kvshare-bench refuses any
  // other, and a choice or a count outside what the flag takes, before anything runs.
  std::vector<GroupFlag> flags = {};
  // The prompt lengths when --tokens is not given; empty: the group takes no --tokens.
  std::vector<int> tokens = {};
  // The same under --smoke; empty: `tokens`.
  std::vector<int> smoke_tokens = {};
};

// Adds a group; used from a static initialiser in each <group>_bench.cc:
//   static const bool registered = kvshare::bench::add_group({...});
bool add_group(Group group);

// The items of a comma-list flag's value ("cpu,auto,cpu" -> {"cpu", "auto"}): in order,
// empty items and repeats dropped.
inline std::vector<std::string> split_list(const std::string& list) {
  std::vector<std::string> items;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t end = std::min(list.find(',', start), list.size());
    std::string item = list.substr(start, end - start);
    if (!item.empty() && std::find(items.begin(), items.end(), item) == items.end()) items.push_back(std::move(item));
    start = end + 1;
  }
  return items;
}

// Finds runs whose name starts with `prefix`, in run order.
std::vector<const RunResult*> runs_with_prefix(const std::vector<RunResult>& runs, const std::string& prefix);

// Median over runs named exactly `name` (repetitions), 0 when there is none.
double median_seconds(const std::vector<RunResult>& runs, const std::string& name);

}  // namespace kvshare::bench
