// kvshare-bench load-mix: long replies streaming while long prompts arrive (issue #43). S
// streams (--streams, default 3) decode --stream-tokens replies (default 1000, ignore_eos,
// streamed) on a patched llama-server with -np max(4, S + 1) through kvshare-serve, and once
// every stream has its first token --arrivals N prompts of --tokens T tokens (default 2000)
// arrive, one every --interval-ms (each value its own case), into the free slots, each asking
// for 4 tokens. Configurations, one serve each, the same prompts:
//
//   cpu          --device cpu: the decoder alone
//   auto         --device hybrid --handoff auto
//   always       --device hybrid --handoff always
//   never        --device hybrid --handoff never
//   auto-slow    --handoff auto with a slower provider: a per-request provider behind a
//                wrapper that sleeps 1 s before it starts (as tests/integration/serve_load.py)
//
// Resources are pinned alike where the machine has two cores: serve and its decoder (-t 1) on
// core 0 (the bench starts serve from a thread pinned there; the children inherit it), the
// provider on core 1 (a wrapper script that execs it under `taskset -c 1`). The hybrid
// configurations take the shared route (ONEBIT_KV_SHARE=1) and, but for auto-slow, a
// resident provider (--provider-resident). The provider is kvshare-prefill, the reference
// provider (or --provider PATH): the load measurement in docs/hybrid.md used it, and on the
// generated model it is about as fast per token as the decoder, so the rule weighs the load
// and not a provider that is plainly faster. Serve first learns both speeds from two
// untimed prompts of T tokens.
//
// Per configuration and interval: the streams' inter-token gaps (p50, p99, max) over the gaps
// that overlap the arrivals' window (the first arrival sent .. the last one answered); the
// arrivals' first byte (p50, p99); tokens/s of the whole box (every token generated / the wall
// time of the mix); how many arrivals serve handed off (its `hybrid:` lines for prompts of T
// tokens). A gap is the time between two pieces of a stream's reply as the bench reads them
// (events that come in one piece count as gaps of 0).
//
// The patched llama-server is --backend PATH, else $LLAMA_SERVER_KVSHARE; without one the
// group says why and runs nothing.
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench_completion.h"
#include "bench_files.h"
#include "bench_registry.h"
#include "bench_serve.h"
#include "bench_stats.h"
#include "route/decoder_client.h"
#include "route/upstream_stream.h"

namespace kvshare::bench {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

const char* const kConfigChoices[] = {"cpu", "auto", "always", "never", "auto-slow"};
constexpr int kArrivalTokens = 4;    // each arrival's reply
constexpr int kStreamPrompt = 16;    // each stream's prompt
constexpr double kSlowStartS = 1.0;  // auto-slow's provider wrapper sleeps this long

struct Settings {
  fs::path backend;
  std::string backend_why;
  fs::path provider;
  std::string resident_why;
  int streams = 3;
  int stream_tokens = 1000;
  int arrivals = 3;
  int tokens = 2000;
  int np = 4;
  int n_ctx = 8192;
  std::vector<int> intervals;
  std::vector<std::string> configs;
  bool pin = false;
};

Settings& settings() {
  static Settings s;
  return s;
}

std::string label(const std::string& config) {
  if (config == "cpu") return "--device cpu";
  if (config == "auto-slow") return "hybrid auto, provider +1 s";
  return "hybrid " + config;
}

struct Setup {
  fs::path dir;
  fs::path model;
  std::map<std::string, std::unique_ptr<ServeUnderTest>> serves;
  std::map<std::string, std::string> not_run;
  std::string why;
  int tokenizer_port = 0;
  int salt = 0;
  size_t turn = 0;
  bool started = false;
};

Setup& setup_state() {
  static Setup s;
  return s;
}

fs::path write_wrapper(const fs::path& dir, const std::string& name, const std::string& before, const fs::path& prog,
                       bool pin) {
  const fs::path path = dir / name;
  std::ofstream out(path);
  out << "#!/bin/sh\n" << before << "exec " << (pin ? "taskset -c 1 " : "") << "'" << prog.string() << "' \"$@\"\n";
  out.close();
  ::chmod(path.c_str(), 0755);
  return path;
}

struct Reply {
  double first_byte_ms = 0;
  int tokens = 0;
  std::vector<Clock::time_point> pieces;  // when each event arrived
};

// One streamed completion; `pieces` holds the arrival time of each event.
Result<Reply> streamed(int port, const std::string& prompt, int n_predict) {
  auto completion = stream_completion(port, prompt, n_predict);
  if (!completion) return tl::unexpected(completion.error());
  Reply reply;
  reply.first_byte_ms = completion->first_byte_ms;
  reply.pieces = std::move(completion->events);
  reply.tokens = static_cast<int>(reply.pieces.size());
  return reply;
}

std::unique_ptr<ServeUnderTest> start_config(const std::string& config, Setup& made, std::string& why) {
  const Settings& s = settings();
  ServeLaunch launch;
  launch.name = config;
  launch.args = {"-m",        made.model.string(),
                 "--device",  config == "cpu" ? "cpu" : "hybrid",
                 "--backend", s.backend.string(),
                 "-c",        std::to_string(s.n_ctx),
                 "-fa",       "on",
                 "-ctk",      "f16",
                 "-ctv",      "f16",
                 "-np",       std::to_string(s.np)};
  if (config != "cpu") {
    const bool slow = config == "auto-slow";
    const fs::path provider =
        write_wrapper(made.dir, "provider-" + config, slow ? fmt::format("sleep {}\n", kSlowStartS) : std::string(),
                      s.provider, s.pin);
    launch.args.insert(launch.args.end(), {"--prefill-provider", provider.string(), "--handoff", slow ? "auto" : config,
                                           "--provider-timeout", "1800"});
    if (!slow && s.resident_why.empty()) launch.args.push_back("--provider-resident");
    launch.kv_share = true;
  }
  launch.args.insert(launch.args.end(), {"--", "-t", "1"});
  // Serve and its decoder on core 0: fork copies the calling thread's affinity.
  cpu_set_t before, core0;
  const bool pinned = s.pin && ::sched_getaffinity(0, sizeof before, &before) == 0;
  if (pinned) {
    CPU_ZERO(&core0);
    CPU_SET(0, &core0);
    ::sched_setaffinity(0, sizeof core0, &core0);
  }
  auto serve = start_serve(launch, made.dir, why);
  if (pinned) ::sched_setaffinity(0, sizeof before, &before);
  if (!serve) {
    const std::string line = last_log_line(made.dir / ("serve-" + launch.name + ".log"));
    if (!line.empty()) why += ": " + line;
  }
  return serve;
}

void stop_setup() {
  Setup& s = setup_state();
  s.serves.clear();
  std::error_code ec;
  if (!s.dir.empty()) fs::remove_all(s.dir, ec);
  s = Setup{};
}

Setup& setup() {
  Setup& made = setup_state();
  if (made.started) return made;
  made.started = true;
  const Settings& s = settings();
  if (!s.backend_why.empty()) {
    made.why = s.backend_why;
    return made;
  }
  auto model = make_bench_model("kvshare-bench-load-mix", {s.backend, s.provider}, made.why,
                                {"--layers", "8", "--embd", "256", "--ff", "768"}, s.n_ctx);
  if (!model) return made;
  made.dir = model->dir;
  made.model = model->model;
  for (const std::string& config : s.configs) {
    std::string why;
    auto serve = start_config(config, made, why);
    if (!serve) {
      made.not_run[config] = why;
      continue;
    }
    // Two untimed prompts of T tokens: serve learns the decoder's and the provider's speed.
    const route::DecoderClient decoder("127.0.0.1", serve->decoder_port, std::chrono::seconds(120));
    for (int i = 0; i < 2; ++i)
      if (auto warm = streamed(serve->port, prompt_of(decoder, s.tokens, ++made.salt), 2); !warm) {
        why = fmt::format("warm-up request failed: {}; serve's last line: {}", warm.error().what(),
                          last_log_line(serve->stderr_path));
        break;
      }
    if (!why.empty()) {
      made.not_run[config] = why;
      continue;
    }
    if (made.tokenizer_port == 0) made.tokenizer_port = serve->decoder_port;
    made.serves[config] = std::move(serve);
  }
  if (made.serves.empty()) made.why = "no configuration started (see the lines on what was not run)";
  return made;
}

struct Mix {
  std::vector<double> gaps_ms;        // the streams' gaps overlapping the arrivals' window
  std::vector<double> first_byte_ms;  // the arrivals'
  double tokens_per_s = 0;
  int handed_off = 0;
  int errors = 0;
  int streams_ended_early = 0;  // streams done before the last arrival was answered
  std::string first_error;
};

Mix run_mix(ServeUnderTest& serve, const std::vector<std::string>& stream_prompts,
            const std::vector<std::string>& arrival_prompts, int interval_ms) {
  const Settings& st = settings();
  const size_t log_before = read_all(serve.stderr_path).size();
  Mix mix;
  std::mutex mutex;
  std::vector<Reply> stream_replies(stream_prompts.size()), arrival_replies(arrival_prompts.size());
  auto note_error = [&](const std::string& what) {
    std::lock_guard lock(mutex);
    if (mix.errors++ == 0) mix.first_error = what;
  };
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  for (size_t i = 0; i < stream_prompts.size(); ++i)
    threads.emplace_back([&, i] {
      auto reply = streamed(serve.port, stream_prompts[i], st.stream_tokens);
      if (reply)
        stream_replies[i] = std::move(*reply);
      else
        note_error(reply.error().what());
    });
  // The streams' prompts are short (16 tokens): 300 ms lets each one reach its decoding.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto window_start = Clock::now();
  std::vector<std::thread> arrivals;
  for (size_t i = 0; i < arrival_prompts.size(); ++i) {
    std::this_thread::sleep_until(window_start + std::chrono::milliseconds(interval_ms) * static_cast<int>(i));
    arrivals.emplace_back([&, i] {
      auto reply = streamed(serve.port, arrival_prompts[i], kArrivalTokens);
      if (reply)
        arrival_replies[i] = std::move(*reply);
      else
        note_error(reply.error().what());
    });
  }
  for (std::thread& t : arrivals) t.join();
  const auto window_end = Clock::now();
  for (std::thread& t : threads) t.join();
  const double wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  int tokens = 0;
  for (const Reply& r : stream_replies) {
    tokens += r.tokens;
    if (!r.pieces.empty() && r.pieces.back() < window_end) ++mix.streams_ended_early;
    for (size_t k = 1; k < r.pieces.size(); ++k)
      if (r.pieces[k] > window_start && r.pieces[k - 1] < window_end)
        mix.gaps_ms.push_back(std::chrono::duration<double, std::milli>(r.pieces[k] - r.pieces[k - 1]).count());
  }
  for (const Reply& r : arrival_replies) {
    tokens += r.tokens;
    if (r.tokens > 0) mix.first_byte_ms.push_back(r.first_byte_ms);
  }
  mix.tokens_per_s = wall_s > 0 ? tokens / wall_s : 0;
  // Serve writes its hybrid: line before the first byte; the pipe to the file may lag.
  const std::regex handed_re(fmt::format(R"(hybrid: {} prompt tokens[^\n]*: prefill [\d.]+ ms)", st.tokens));
  for (int i = 0; i < 50; ++i) {
    const std::string log = read_all(serve.stderr_path);
    const std::string fresh = log.size() > log_before ? log.substr(log_before) : std::string();
    mix.handed_off = static_cast<int>(
        std::distance(std::sregex_iterator(fresh.begin(), fresh.end(), handed_re), std::sregex_iterator()));
    if (mix.handed_off >= static_cast<int>(arrival_prompts.size())) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return mix;
}

std::map<std::string, std::string>& error_lines() {
  static std::map<std::string, std::string> lines;
  return lines;
}

void bm_interval(benchmark::State& state) {
  const int interval_ms = static_cast<int>(state.range(0));
  const Settings& st = settings();
  Setup& s = setup();
  if (!s.why.empty()) return state.SkipWithError(s.why.c_str());
  std::vector<std::string> keys;
  for (const std::string& config : st.configs)
    if (s.serves.count(config)) keys.push_back(config);
  const route::DecoderClient decoder("127.0.0.1", s.tokenizer_port, std::chrono::seconds(120));
  for (auto _ : state) {
    double round_s = 0;
    for (size_t k = 0; k < keys.size(); ++k) {
      const std::string& key = keys[(s.turn + k) % keys.size()];
      // Fresh prompts for each configuration: nothing cached from the one before.
      std::vector<std::string> stream_prompts, arrival_prompts;
      for (int i = 0; i < st.streams; ++i) stream_prompts.push_back(prompt_of(decoder, kStreamPrompt, ++s.salt));
      for (int i = 0; i < st.arrivals; ++i) arrival_prompts.push_back(prompt_of(decoder, st.tokens, ++s.salt));
      const auto begin = Clock::now();
      const Mix mix = run_mix(*s.serves[key], stream_prompts, arrival_prompts, interval_ms);
      round_s += std::chrono::duration<double>(Clock::now() - begin).count();
      const std::string p = key + ".";
      state.counters[p + "gap_p50"] = percentile(mix.gaps_ms, 0.5);
      state.counters[p + "gap_p99"] = percentile(mix.gaps_ms, 0.99);
      state.counters[p + "gap_max"] =
          mix.gaps_ms.empty() ? 0 : *std::max_element(mix.gaps_ms.begin(), mix.gaps_ms.end());
      state.counters[p + "gaps"] = static_cast<double>(mix.gaps_ms.size());
      state.counters[p + "fb_p50"] = percentile(mix.first_byte_ms, 0.5);
      state.counters[p + "fb_p99"] = percentile(mix.first_byte_ms, 0.99);
      state.counters[p + "tps"] = mix.tokens_per_s;
      state.counters[p + "handed_off"] = mix.handed_off;
      state.counters[p + "errors"] = mix.errors;
      state.counters[p + "ended_early"] = mix.streams_ended_early;
      if (mix.errors > 0) error_lines()[fmt::format("{}/{}", interval_ms, key)] = mix.first_error;
    }
    ++s.turn;
    state.SetIterationTime(round_s);
  }
  state.counters["interval_ms"] = interval_ms;
}

void register_all(const BenchArgs& args) {
  Settings& s = settings();
  s = Settings{};
  std::string backend_given;
  fs::path provider_given;
  std::vector<std::string> configs_asked;
  bool streams_given = false, stream_tokens_given = false, arrivals_given = false, configs_given = false;
  for (size_t i = 0; i + 1 < args.rest.size(); ++i) {
    const std::string& flag = args.rest[i];
    if (flag == "--backend")
      backend_given = args.rest[++i];
    else if (flag == "--provider")
      provider_given = args.rest[++i];
    else if (flag == "--configs")
      configs_asked = split_list(args.rest[++i]), configs_given = true;
    else if (flag == "--streams")
      s.streams = std::max(1, std::atoi(args.rest[++i].c_str())), streams_given = true;
    else if (flag == "--stream-tokens")
      s.stream_tokens = std::max(1, std::atoi(args.rest[++i].c_str())), stream_tokens_given = true;
    else if (flag == "--arrivals")
      s.arrivals = std::max(1, std::atoi(args.rest[++i].c_str())), arrivals_given = true;
    else if (flag == "--interval-ms")
      for (const std::string& item : split_list(args.rest[++i]))
        s.intervals.push_back(std::max(1, std::atoi(item.c_str())));
  }
  // --smoke: proves the group runs (a few seconds a configuration), not a measurement.
  if (args.smoke && !streams_given) s.streams = 1;
  if (args.smoke && !stream_tokens_given) s.stream_tokens = 200;
  if (args.smoke && !arrivals_given) s.arrivals = 1;
  if (s.intervals.empty()) s.intervals = {args.smoke ? 100 : 1000};
  std::sort(s.intervals.begin(), s.intervals.end());
  s.intervals.erase(std::unique(s.intervals.begin(), s.intervals.end()), s.intervals.end());
  if (!configs_given) {
    configs_asked.assign(std::begin(kConfigChoices), std::end(kConfigChoices));
    if (args.smoke) configs_asked = {"cpu", "auto"};
  }
  for (const char* choice : kConfigChoices)
    if (std::find(configs_asked.begin(), configs_asked.end(), choice) != configs_asked.end())
      s.configs.push_back(choice);
  s.tokens = args.tokens.front();
  if (!backend_given.empty())
    s.backend = backend_given;
  else if (const char* env = std::getenv("LLAMA_SERVER_KVSHARE"); env != nullptr && *env != '\0')
    s.backend = env;
  else
    s.backend_why = "no patched llama-server: pass --backend PATH or set LLAMA_SERVER_KVSHARE";
  s.provider = !provider_given.empty() ? provider_given : bin("kvshare-prefill");
  if (!s.backend.empty() && !fs::exists(s.backend))
    s.backend_why = fmt::format("{} does not exist", s.backend.string());
  else if (!fs::exists(s.provider))
    s.backend_why = fmt::format("{} (the provider) does not exist", s.provider.string());
  if (s.backend_why.empty()) s.resident_why = resident_support(s.provider);
  s.pin = std::thread::hardware_concurrency() >= 2 && ::access("/usr/bin/taskset", X_OK) == 0;
  s.np = std::max(4, s.streams + 1);
  // llama-server splits -c between its slots: each holds a prompt and its reply.
  const int per_slot = std::max(s.tokens + kArrivalTokens, kStreamPrompt + s.stream_tokens) + 64;
  s.n_ctx = std::max(4096, (per_slot * s.np + 255) / 256 * 256);
  for (int interval : s.intervals)
    benchmark::RegisterBenchmark(fmt::format("load-mix/interval_ms:{}", interval).c_str(), bm_interval)
        ->Arg(interval)
        ->Iterations(1)
        ->UseManualTime()
        ->Unit(benchmark::kSecond);
}

int report(const std::vector<RunResult>& runs, const BenchArgs& args) {
  const Settings& st = settings();
  Setup& s = setup_state();
  if (!args.json) {
    fmt::print(
        "\nload-mix ({} stream(s) of {} tokens decoding while {} prompt(s) of {} tokens arrive, one every "
        "interval; generated 8-layer model, -c {} -np {} -fa on f16, decoder -t 1; {}; provider {}{})\n",
        st.streams, st.stream_tokens, st.arrivals, st.tokens, st.n_ctx, st.np,
        st.pin ? "serve+decoder on core 0, provider on core 1" : "not pinned (fewer than 2 cores or no taskset)",
        st.provider.string(), st.resident_why.empty() ? " resident" : " per request (" + st.resident_why + ")");
    if (std::find(st.configs.begin(), st.configs.end(), "auto-slow") != st.configs.end())
      fmt::print("auto-slow: --handoff auto, the provider per request behind a wrapper that sleeps {} s first\n",
                 kSlowStartS);
    fmt::print("{:>9} {:<28} {:>10} {:>10} {:>10} {:>6} {:>10} {:>10} {:>9} {:>10} {:>6}\n", "interval",
               "configuration", "gap p50", "gap p99", "gap max", "gaps", "fb p50 ms", "fb p99 ms", "tokens/s",
               "handed off", "errors");
  }
  std::vector<std::string> notes;
  for (const RunResult* run : runs_with_prefix(runs, "load-mix/")) {
    auto c = [&](const std::string& key) { return run->counters.count(key) ? run->counters.at(key) : 0.0; };
    const int interval = static_cast<int>(c("interval_ms"));
    if (interval == 0) continue;
    for (const std::string& config : st.configs) {
      const std::string p = config + ".";
      if (!run->counters.count(p + "gaps")) continue;
      const std::string error_line = error_lines()[fmt::format("{}/{}", interval, config)];
      if (c(p + "errors") > 0)
        notes.push_back(fmt::format("{} ms, {}: {} request(s) failed, the first: {}", interval, label(config),
                                    c(p + "errors"), error_line));
      if (c(p + "ended_early") > 0)
        notes.push_back(fmt::format("{} ms, {}: {} stream(s) ended before the last arrival was answered", interval,
                                    label(config), c(p + "ended_early")));
      if (args.json) {
        fmt::print(
            "{{\"bench\":\"load_mix\",\"config\":\"{}\",\"interval_ms\":{},\"streams\":{},\"stream_tokens\":{},"
            "\"arrivals\":{},\"tokens\":{},\"np\":{},\"pinned\":{},\"gap_ms_p50\":{:.3f},\"gap_ms_p99\":{:.3f},"
            "\"gap_ms_max\":{:.3f},\"gaps\":{},\"first_byte_ms_p50\":{:.3f},\"first_byte_ms_p99\":{:.3f},"
            "\"tokens_per_s\":{:.3f},\"handed_off\":{},\"errors\":{},\"streams_ended_early\":{}",
            config, interval, st.streams, st.stream_tokens, st.arrivals, st.tokens, st.np, st.pin, c(p + "gap_p50"),
            c(p + "gap_p99"), c(p + "gap_max"), c(p + "gaps"), c(p + "fb_p50"), c(p + "fb_p99"), c(p + "tps"),
            c(p + "handed_off"), c(p + "errors"), c(p + "ended_early"));
        if (!error_line.empty()) fmt::print(",\"error\":{}", nlohmann::json(error_line).dump());
        fmt::print("}}\n");
        continue;
      }
      fmt::print("{:>9} {:<28} {:>10.1f} {:>10.1f} {:>10.1f} {:>6} {:>10.1f} {:>10.1f} {:>9.1f} {:>10} {:>6}\n",
                 fmt::format("{} ms", interval), label(config), c(p + "gap_p50"), c(p + "gap_p99"), c(p + "gap_max"),
                 c(p + "gaps"), c(p + "fb_p50"), c(p + "fb_p99"), c(p + "tps"),
                 config == "cpu" ? std::string("-") : fmt::format("{}/{}", c(p + "handed_off"), st.arrivals),
                 c(p + "errors"));
    }
  }
  for (const std::string& config : st.configs)
    if (s.not_run.count(config)) {
      if (args.json)
        fmt::print("{{\"bench\":\"load_mix_not_run\",\"config\":\"{}\",\"why\":{}}}\n", config,
                   nlohmann::json(s.not_run.at(config)).dump());
      else
        fmt::print("{} not run: {}\n", label(config), s.not_run.at(config));
    }
  if (!args.json) {
    if (!s.why.empty()) fmt::print("nothing run: {}\n", s.why);
    for (const std::string& note : notes) fmt::print("{}\n", note);
    fmt::print(
        "(gap: ms between two pieces of a stream's reply, over the gaps overlapping the arrivals' window; fb: an "
        "arrival's first byte; tokens/s: every token generated / the mix's wall time; handed off: arrivals serve's "
        "hybrid: lines say a provider prefilled)\n");
  }
  stop_setup();
  return 0;
}

const bool registered = add_group({
    "load-mix",
    "long replies streaming while long prompts arrive (issue 43): the streams' inter-token gaps and the arrivals' "
    "first byte with --device cpu and hybrid --handoff auto|always|never (and auto with a slower provider); "
    "--tokens T sets the arriving prompts' length (default 2000)",
    register_all,
    report,
    {
        {"--backend", "PATH", "the patched llama-server (default $LLAMA_SERVER_KVSHARE)"},
        {"--provider", "PATH", "the provider (default kvshare-prefill, resident, pinned to core 1)"},
        {"--configs", "cpu|auto|always|never|auto-slow[,...]",
         "the serves measured (default all; smoke cpu,auto; auto-slow: auto with the provider behind a 1 s sleep)"},
        {"--streams", "N", "replies decoding while the prompts arrive (default 3; smoke 1)"},
        {"--stream-tokens", "N", "tokens each stream generates, ignore_eos on (default 1000; smoke 200)"},
        {"--arrivals", "N", "prompts arriving during the streams (default 3; smoke 1)"},
        {"--interval-ms", "N[,...]", "ms between two arrivals, each value a case of its own (default 1000; smoke 100)"},
    },
    {2000},
    {16},
});

}  // namespace
}  // namespace kvshare::bench
