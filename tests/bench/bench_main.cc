// kvshare-bench GROUP [--json] [--smoke] [--tokens N,N] [-- group flags] [--benchmark_* flags]
// Runs one group's Google Benchmark cases and prints its side-by-side report.
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <unistd.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "bench_registry.h"
#include "refmodel/blas_kernels.h"

namespace kvshare::bench {
namespace {

std::map<std::string, Group>& groups() {
  static std::map<std::string, Group> g;
  return g;
}

// Collects every run; forwards to the console reporter unless JSON output is asked for.
class CollectingReporter : public benchmark::ConsoleReporter {
 public:
  explicit CollectingReporter(bool quiet) : quiet_(quiet) {}
  bool ReportContext(const Context& context) override {
    return quiet_ ? true : ConsoleReporter::ReportContext(context);
  }
  void ReportRuns(const std::vector<Run>& reports) override {
    for (const Run& run : reports) {
      if (run.run_type != Run::RT_Iteration || run.error_occurred) continue;
      RunResult result;
      result.name = run.run_name.str();
      result.iterations = run.iterations;
      result.seconds_per_iteration =
          run.iterations > 0 ? run.real_accumulated_time / static_cast<double>(run.iterations) : 0;
      for (const auto& [key, counter] : run.counters) result.counters[key] = counter.value;
      results.push_back(std::move(result));
    }
    if (!quiet_) ConsoleReporter::ReportRuns(reports);
  }
  std::vector<RunResult> results;

 private:
  bool quiet_;
};

// "--rows f32|f16", "--buffered".
std::string flag_usage(const GroupFlag& flag) { return flag.value.empty() ? flag.name : flag.name + " " + flag.value; }

// To stdout for --help, to stderr after a bad argument.
void print_usage(std::FILE* to = stderr) {
  std::fprintf(
      to,
      "usage: kvshare-bench GROUP [--json] [--smoke] [--tokens N[,N...]] [--benchmark_* flags] [-- group flags]\n"
      "       kvshare-bench route|conversation [--backend PATH] [--provider PATH] ...   (another decoder, e.g. "
      "llama-server)\n"
      "       kvshare-bench load [--tokens T] [--json] [group flags]   (a group's flags may also come before --)\n"
      "       kvshare-bench all --smoke   (every group, tiny sizes: a check that they run)\n\n"
      "groups:\n");
  for (const auto& [name, group] : groups()) std::fprintf(to, "  %-10s %s\n", name.c_str(), group.help.c_str());
  std::fprintf(to, "\ngroup flags (after --, or before it):\n");
  for (const auto& [name, group] : groups())
    for (const GroupFlag& flag : group.flags)
      std::fprintf(to, "  %-10s %-22s %s\n", name.c_str(), flag_usage(flag).c_str(), flag.help.c_str());
}

int run_group(const Group& group, const BenchArgs& args, std::vector<char*> gbench_argv) {
  benchmark::ClearRegisteredBenchmarks();
  group.register_benchmarks(args);
  int gbench_argc = static_cast<int>(gbench_argv.size());
  benchmark::Initialize(&gbench_argc, gbench_argv.data());
  CollectingReporter reporter(args.json);
  benchmark::RunSpecifiedBenchmarks(&reporter);
  return group.report(reporter.results, args);
}

}  // namespace

// `name` among the flags of group `group_name`; nullptr when the group or the flag is unknown.
const GroupFlag* group_flag(const std::string& group_name, const std::string& name) {
  const auto group = groups().find(group_name);
  if (group == groups().end()) return nullptr;
  for (const GroupFlag& flag : group->second.flags)
    if (flag.name == name) return &flag;
  return nullptr;
}

bool add_group(Group group) {
  std::string name = group.name;
  return groups().emplace(std::move(name), std::move(group)).second;
}

std::string check_group_flags(const Group& group, const std::vector<std::string>& rest) {
  for (size_t i = 0; i < rest.size(); ++i) {
    const auto known =
        std::find_if(group.flags.begin(), group.flags.end(), [&](const GroupFlag& f) { return f.name == rest[i]; });
    if (known == group.flags.end()) {
      std::string takes;
      for (const GroupFlag& flag : group.flags) takes += (takes.empty() ? "" : ", ") + flag_usage(flag);
      return "unknown flag \"" + rest[i] + "\" (this group takes: " + (takes.empty() ? "none" : takes) + ")";
    }
    if (known->value.empty()) continue;
    if (i + 1 >= rest.size()) return known->name + " needs " + known->value;
    const std::string& value = rest[++i];
    // "a|b[,...]": a comma list of the choices ("--arch qwen3,gemma3").
    const std::string list_mark = "[,...]";
    const bool is_list = known->value.size() > list_mark.size() && known->value.ends_with(list_mark);
    const std::string choices = is_list ? known->value.substr(0, known->value.size() - list_mark.size()) : known->value;
    const bool is_choice = choices.find('|') != std::string::npos;
    for (size_t from = 0; is_choice && from <= value.size();) {
      const size_t comma = is_list ? std::min(value.find(',', from), value.size()) : value.size();
      const std::string item = value.substr(from, comma - from);
      if (("|" + choices + "|").find("|" + item + "|") == std::string::npos)
        return known->name + " \"" + item + "\": not one of " + choices;
      from = comma + 1;
    }
    // "N" a positive count; "N[,...]" a comma list of them ("--clients 1,4,16").
    for (size_t from = 0; choices == "N" && from <= value.size();) {
      const size_t comma = is_list ? std::min(value.find(',', from), value.size()) : value.size();
      const std::string item = value.substr(from, comma - from);
      if (item.empty() || item.find_first_not_of("0123456789") != std::string::npos || std::atoi(item.c_str()) < 1)
        return known->name + " \"" + (is_list ? item : value) + "\": not a positive count";
      from = comma + 1;
    }
  }
  return "";
}

std::vector<const RunResult*> runs_with_prefix(const std::vector<RunResult>& runs, const std::string& prefix) {
  std::vector<const RunResult*> out;
  for (const auto& run : runs)
    if (run.name.rfind(prefix, 0) == 0) out.push_back(&run);
  return out;
}

double median_seconds(const std::vector<RunResult>& runs, const std::string& name) {
  std::vector<double> values;
  for (const auto& run : runs)
    if (run.name == name) values.push_back(run.seconds_per_iteration);
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

}  // namespace kvshare::bench

int main(int argc, char** argv) {
  using namespace kvshare::bench;
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    print_usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  for (int i = 2; i < argc && std::strcmp(argv[i], "--") != 0; ++i)
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) {
      print_usage(stdout);
      return 0;
    }
  std::string group_name = argv[1];
  kvshare::refmodel::reexec_with_best_blas_kernels(argv);  // the prefill group's BLAS speed
  // OpenBLAS starts its worker threads when the library loads, and they spin in
  // sched_yield for a while: on a 2-core machine that steals a core from whatever is being
  // measured (20% of the samples of `statefile` on the CI VM). Only the prefill group runs
  // BLAS in this process, so every other group re-executes itself once with one BLAS thread
  // (an explicit OPENBLAS_NUM_THREADS is left as it is).
  if (group_name != "prefill" && group_name != "all" && std::getenv("OPENBLAS_NUM_THREADS") == nullptr) {
    ::setenv("OPENBLAS_NUM_THREADS", "1", 1);
    ::execv("/proc/self/exe", argv);  // on failure, go on with the threads as they are
  }
  BenchArgs args;
  std::vector<char*> gbench_argv{argv[0]};
  static std::string min_time_flag = "--benchmark_min_time=0";
  bool after_dashdash = false;
  for (int i = 2; i < argc; ++i) {
    std::string arg = argv[i];
    if (after_dashdash) {
      args.rest.push_back(arg);
    } else if (arg == "--") {
      after_dashdash = true;
    } else if (arg == "--json") {
      args.json = true;
    } else if (arg == "--smoke") {
      args.smoke = true;
    } else if ((arg == "--backend" || arg == "--provider") && i + 1 < argc) {
      args.rest.push_back(arg);  // route and conversation: the decoder and provider (route_bench.cc)
      args.rest.push_back(argv[++i]);
    } else if (arg == "--tokens" && i + 1 < argc) {
      std::string list = argv[++i];
      size_t start = 0;
      while (start <= list.size()) {
        size_t comma = list.find(',', start);
        std::string item = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        try {
          int n = std::stoi(item);
          if (n <= 0) throw std::out_of_range("not positive");
          args.tokens.push_back(n);
        } catch (const std::exception&) {
          std::fprintf(stderr, "kvshare-bench: --tokens: \"%s\" is not a positive token count\n", item.c_str());
          return 2;
        }
        if (comma == std::string::npos) break;
        start = comma + 1;
      }
    } else if (arg.rfind("--benchmark_", 0) == 0) {
      gbench_argv.push_back(argv[i]);
    } else if (const GroupFlag* flag = group_flag(group_name, arg)) {
      // A flag of the group named may come before "--" too ("load --clients 1,4").
      args.rest.push_back(arg);
      if (!flag->value.empty() && i + 1 < argc) args.rest.push_back(argv[++i]);
    } else {
      std::fprintf(stderr, "kvshare-bench: unknown argument \"%s\"\n", arg.c_str());
      print_usage();
      return 2;
    }
  }
  if (args.smoke) gbench_argv.push_back(min_time_flag.data());
  gbench_argv.push_back(nullptr);
  gbench_argv.pop_back();

  if (group_name == "all") {
    if (!args.rest.empty()) {
      std::fprintf(stderr, "kvshare-bench all: group flags (\"%s\") go to one group, not to all\n",
                   args.rest[0].c_str());
      return 2;
    }
    int rc = 0;
    for (const auto& [name, group] : groups()) {
      std::fprintf(stderr, "== kvshare-bench %s\n", name.c_str());
      rc |= run_group(group, args, gbench_argv);
    }
    return rc;
  }
  auto it = groups().find(group_name);
  if (it == groups().end()) {
    std::fprintf(stderr, "kvshare-bench: unknown group \"%s\"\n", group_name.c_str());
    print_usage();
    return 2;
  }
  if (const std::string bad = check_group_flags(it->second, args.rest); !bad.empty()) {
    std::fprintf(stderr, "kvshare-bench %s: %s\n", group_name.c_str(), bad.c_str());
    return 2;
  }
  return run_group(it->second, args, gbench_argv);
}
