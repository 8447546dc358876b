// kvshare-bench GROUP [--json] [--smoke] [--tokens N,N] [group flags] [--benchmark_* flags]
// Runs one group's Google Benchmark cases and prints its side-by-side report; `all` runs
// every group. The command line is CLI11's, as every tool's: one subcommand per group.
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <unistd.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
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

// "" when `value` is what `flag` takes, else the message naming the flag and the bad item.
// "a|b": one of the choices; "N": a positive count; "...[,...]": a comma list of them.
std::string value_error(const GroupFlag& flag, const std::string& value) {
  const std::string list_mark = "[,...]";
  const bool is_list = flag.value.size() > list_mark.size() && flag.value.ends_with(list_mark);
  const std::string choices = is_list ? flag.value.substr(0, flag.value.size() - list_mark.size()) : flag.value;
  const bool is_choice = choices.find('|') != std::string::npos;
  if (!is_choice && choices != "N") return "";
  for (size_t from = 0; from <= value.size();) {
    const size_t comma = is_list ? std::min(value.find(',', from), value.size()) : value.size();
    const std::string item = value.substr(from, comma - from);
    if (is_choice && ("|" + choices + "|").find("|" + item + "|") == std::string::npos)
      return flag.name + " \"" + item + "\": not one of " + choices;
    if (!is_choice && (item.empty() || item.size() > 9 || item.find_first_not_of("0123456789") != std::string::npos ||
                       std::atoi(item.c_str()) < 1))
      return flag.name + " \"" + item + "\": not a positive count";
    from = comma + 1;
  }
  return "";
}

// "307,4096" (checked by value_error) -> {307, 4096}.
std::vector<int> split_counts(const std::string& list) {
  std::vector<int> counts;
  for (size_t from = 0; from <= list.size();) {
    const size_t comma = std::min(list.find(',', from), list.size());
    counts.push_back(std::atoi(list.substr(from, comma - from).c_str()));
    from = comma + 1;
  }
  return counts;
}

std::string join_counts(const std::vector<int>& counts) {
  std::string out;
  for (int n : counts) out += (out.empty() ? "" : ",") + std::to_string(n);
  return out;
}

// Adds `flag` to `command`: each occurrence is checked (a bad value throws the message CLI11
// prints) and appended to `into` as the group reads it, name then value.
void add_flag_option(CLI::App& command, const GroupFlag& flag, std::vector<std::string>& into) {
  if (flag.value.empty()) {
    command.add_flag_function(
        flag.name, [&into, name = flag.name](std::int64_t) { into.push_back(name); }, flag.help);
    return;
  }
  auto take = [&into, flag](const std::vector<std::string>& values) {
    for (const std::string& value : values) {
      if (const std::string bad = value_error(flag, value); !bad.empty()) throw CLI::ValidationError(bad);
      into.insert(into.end(), {flag.name, value});
    }
  };
  CLI::Option* option = command.add_option_function<std::vector<std::string>>(flag.name, take, flag.help);
  // One value per occurrence; a list flag may be repeated, any other is given once.
  option->allow_extra_args(false)->expected(1)->type_name(flag.value);
  if (flag.value.ends_with("[,...]")) option->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
}

// What the command line asked for: the subcommand and its BenchArgs.
struct Invocation {
  CLI::App* command = nullptr;
  BenchArgs args;
  std::string tokens;  // --tokens as given (checked); "" when not given
};

// The options every group takes, then the group's own.
void add_group_command(CLI::App& app, const Group& group, Invocation& asked) {
  CLI::App* command = app.add_subcommand(group.name, group.help);
  command->allow_extras();  // the --benchmark_* flags, for Google Benchmark; anything else is refused after parsing
  command->add_flag("--json", asked.args.json, "one JSON object per case on stdout, nothing else");
  command->add_flag("--smoke", asked.args.smoke, "tiny sizes, one iteration: a check that the group runs");
  if (!group.tokens.empty()) {
    std::string defaults = "(default " + join_counts(group.tokens);
    if (!group.smoke_tokens.empty()) defaults += "; --smoke " + join_counts(group.smoke_tokens);
    const GroupFlag tokens{"--tokens", "N[,...]", "prompt lengths in tokens, comma-separated " + defaults + ")"};
    command
        ->add_option_function<std::string>(
            tokens.name,
            [&asked, tokens](const std::string& value) {
              if (const std::string bad = value_error(tokens, value); !bad.empty()) throw CLI::ValidationError(bad);
              asked.tokens = value;
            },
            tokens.help)
        ->type_name(tokens.value);
  }
  for (const GroupFlag& flag : group.flags) add_flag_option(*command, flag, asked.args.rest);
  command->footer("Google Benchmark's --benchmark_* flags pass through (e.g. --benchmark_filter=REGEX).");
  command->callback([&asked, command] { asked.command = command; });
}

int run_group(const Group& group, BenchArgs args) {
  if (args.tokens.empty()) args.tokens = args.smoke && !group.smoke_tokens.empty() ? group.smoke_tokens : group.tokens;
  benchmark::ClearRegisteredBenchmarks();
  group.register_benchmarks(args);
  CollectingReporter reporter(args.json);
  benchmark::RunSpecifiedBenchmarks(&reporter);
  return group.report(reporter.results, args);
}

}  // namespace

bool add_group(Group group) {
  std::string name = group.name;
  return groups().emplace(std::move(name), std::move(group)).second;
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
  CLI::App app{
      "kvshare-bench: what kvshare's routes cost, measured side by side in one run. One subcommand per group; "
      "kvshare-bench GROUP --help lists its options."};
  app.name("kvshare-bench");
  app.require_subcommand(1);
  app.footer(
      "Google Benchmark's --benchmark_* flags pass through after the group (e.g. --benchmark_filter=REGEX).\n"
      "A group's flags may follow \"--\", as older invocations wrote them: route -- --rounds 3.");
  Invocation asked;
  for (const auto& [name, group] : groups()) add_group_command(app, group, asked);
  CLI::App* all = app.add_subcommand("all", "every group in turn; with --smoke, tiny sizes: a check that each runs");
  all->allow_extras();
  all->add_flag("--json", asked.args.json, "one JSON object per case on stdout, nothing else");
  all->add_flag("--smoke", asked.args.smoke, "tiny sizes, one iteration: a check that the groups run");
  all->callback([&asked, all] { asked.command = all; });

  // A group's flags once had to follow "--"; they are options of its subcommand now, and the
  // "--" that the docs' older command lines still carry is dropped.
  std::vector<std::string> words(argv + 1, argv + argc);
  if (auto dashdash = std::find(words.begin(), words.end(), "--"); dashdash != words.end()) words.erase(dashdash);
  // CLI11 2.1 says only "A subcommand is required" for an unknown first word: name it.
  if (!words.empty() && !words[0].starts_with("-") && words[0] != "all" && !groups().contains(words[0])) {
    std::string names;
    for (const auto& [name, group] : groups()) names += name + ", ";
    std::fprintf(stderr, "kvshare-bench: unknown group \"%s\" (groups: %sall)\nRun with --help for more information.\n",
                 words[0].c_str(), names.c_str());
    return 2;
  }
  std::reverse(words.begin(), words.end());  // CLI11 takes a vector last word first
  try {
    app.parse(words);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  const std::string group_name = asked.command->get_name();
  const auto group = groups().find(group_name);
  // What CLI11 left: --benchmark_* flags for Google Benchmark; anything else is a mistake.
  std::vector<std::string> gbench_words;
  for (const std::string& word : asked.command->remaining()) {
    if (word.starts_with("--benchmark_")) {
      gbench_words.push_back(word);
      continue;
    }
    std::string takes;
    if (group != groups().end())
      for (const GroupFlag& flag : group->second.flags) takes += (takes.empty() ? "" : ", ") + flag_usage(flag);
    const std::string what = word.starts_with("-") ? "unknown flag" : "unexpected argument";
    const std::string hint = group == groups().end() ? "all takes no group's flags"
                                                     : "this group takes: " + (takes.empty() ? "none" : takes);
    std::fprintf(stderr, "kvshare-bench %s: %s \"%s\" (%s)\nRun with --help for more information.\n",
                 group_name.c_str(), what.c_str(), word.c_str(), hint.c_str());
    return 2;
  }
  if (!asked.tokens.empty()) asked.args.tokens = split_counts(asked.tokens);

  kvshare::refmodel::reexec_with_best_blas_kernels(argv);  // the prefill group's BLAS speed
  // OpenBLAS starts its worker threads when the library loads, and they spin in
  // sched_yield for a while: on a 2-core machine that steals a core from whatever is being
  // measured (docs/state-file.md, "Performance"). Only the prefill group runs BLAS in this
  // process, so every other group re-executes itself once with one BLAS thread (an explicit
  // OPENBLAS_NUM_THREADS is left as it is).
  if (group_name != "prefill" && group_name != "all" && std::getenv("OPENBLAS_NUM_THREADS") == nullptr) {
    ::setenv("OPENBLAS_NUM_THREADS", "1", 1);
    ::execv("/proc/self/exe", argv);  // on failure, go on with the threads as they are
  }

  if (asked.args.smoke) gbench_words.push_back("--benchmark_min_time=0");
  std::vector<char*> gbench_argv{argv[0]};
  for (std::string& word : gbench_words) gbench_argv.push_back(word.data());
  int gbench_argc = static_cast<int>(gbench_argv.size());
  gbench_argv.push_back(nullptr);
  benchmark::Initialize(&gbench_argc, gbench_argv.data());
  if (benchmark::ReportUnrecognizedArguments(gbench_argc, gbench_argv.data())) return 2;

  if (group != groups().end()) return run_group(group->second, asked.args);
  int rc = 0;
  for (const auto& [name, each] : groups()) {
    std::fprintf(stderr, "== kvshare-bench %s\n", name.c_str());
    rc |= run_group(each, asked.args);
  }
  return rc;
}
