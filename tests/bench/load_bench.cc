// kvshare-bench load: many users at once through kvshare-serve (issue #27). Several serves
// run side by side on one generated model, each with its own decoder:
//
//   cpu-np4      --device cpu -np 4 with the patched llama-server: the plain relay, the
//                decoder alone with four slots (the baseline a hybrid serve must approach)
//   hybrid-np1   --device hybrid -np 1 with the patched llama-server
//   hybrid-np4   --device hybrid -np 4 with the patched llama-server
//   hybrid-np4-kvu  the same with a unified cache (-- -kvu, llama-server's -np auto): each
//                share reserves a run of cells (not run unless asked for)
//   decoder-np1  --device hybrid -np 1 with kvshare-decoder (it has one slot)
//   cpu-np1      --device cpu -np 1 with the patched llama-server (not run unless asked for)
//
// Each hybrid configuration runs once per route of --routes (default shared: ONEBIT_KV_SHARE=1
// for serve and its decoder, as the route group does; file; and the resident-provider twins
// shared_resident, file_resident when the provider takes --serve-fd), with --handoff always
// so that every prompt takes the route.
//
// A phase is C concurrent clients (--clients 1,4,16), each a thread sending its requests in
// a closed loop, the next one when the reply before it has completed, --requests-per-client
// N of them (default 4): distinct prompts of --tokens T tokens (default 300; each starts with
// its own salt, so no two requests share more than BOS and nothing is cached between
// clients or rounds), POST /v1/completions with max_tokens --n-predict P (default 16),
// ignore_eos and stream on, so the first byte is measured apart from the whole reply.
// A round runs one phase per configuration with the same prompts, the order rotating from
// round to round (and from client count to client count), so a slow moment of the machine
// falls on every configuration alike; --rounds N rounds per client count (default 3).
//
// Per configuration and client count: requests/s of each phase (requests / the phase's wall
// time; median and p25..p75 over the rounds), the first byte's p50 and p99 and the whole
// reply's p50 over every request of every round, how many requests serve handed off (its
// `hybrid:` lines) and how many failed. The report ends with the ratio issue #27's target
// needs, round by round: hybrid -np 4 / hybrid -np 1 requests/s at the most clients.
//
// The patched llama-server is --backend PATH (before or after --), else $LLAMA_SERVER_KVSHARE
// (as scripts/test.sh and the integration tests find it), else the first llama-server on PATH
// with llama-kvshare-prefill beside it; without one, only decoder-np1 runs and the report says
// why the others did not. Its provider is llama-kvshare-prefill beside it (or --provider
// PATH); kvshare-decoder's is kvshare-prefill. A serve that refuses its flags (serve before
// -np N landed refuses -np 4) is reported as not run, with serve's own words, and the other
// configurations still run.
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
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

// --configs choices, in the order the report prints them.
const char* const kConfigChoices[] = {"cpu-np1",    "cpu-np4",        "hybrid-np1",
                                      "hybrid-np4", "hybrid-np4-kvu", "decoder-np1"};
const char* const kDefaultConfigs[] = {"cpu-np4", "hybrid-np1", "hybrid-np4", "decoder-np1"};
const char* const kRouteChoices[] = {"shared", "file", "shared_resident", "file_resident"};

struct Config {
  std::string key;     // "hybrid-np4/shared", "cpu-np4": counters and JSON
  std::string choice;  // the --configs choice it comes from
  bool kvshare_decoder = false;
  bool hybrid = false;
  int np = 1;
  bool kv_unified = false;  // -- -kvu: every slot's cells in one stream
  std::string route;        // "" for cpu
  std::string decoder_name() const { return kvshare_decoder ? "kvshare-decoder" : "llama-server"; }
  // "hybrid -np 4 shared (llama-server)"
  std::string label() const {
    return fmt::format("{} -np {}{}{}", hybrid ? "hybrid" : "cpu", np, kv_unified ? " -kvu" : "",
                       route.empty() ? "" : " " + route);
  }
};

bool is_resident(const std::string& route) { return route.ends_with("_resident"); }
std::string handoff_of(const std::string& route) {
  return is_resident(route) ? route.substr(0, route.size() - std::string("_resident").size()) : route;
}

struct Settings {
  fs::path backend;                  // the patched llama-server; empty when none was found
  std::string backend_why;           // why there is none
  fs::path provider;                 // llama-server's provider
  std::string resident_why;          // llama-kvshare-prefill without --serve-fd
  std::string decoder_resident_why;  // kvshare-prefill without --serve-fd
  std::vector<int> clients;
  int requests_per_client = 4;
  int n_predict = 16;
  int tokens = 300;
  int rounds = 3;
  int n_ctx = 8192;
  std::vector<Config> configs;    // everything asked for, in report order
  std::vector<int> extra_tokens;  // --tokens values past the first (not run)
};

Settings& settings() {
  static Settings s;
  return s;
}

bool is_executable(const fs::path& path) { return ::access(path.c_str(), X_OK) == 0 && fs::is_regular_file(path); }

// --backend, else $LLAMA_SERVER_KVSHARE, else a llama-server on PATH with its provider beside it.
void find_backend(Settings& s, const std::string& given) {
  if (!given.empty()) {
    s.backend = given;
    return;
  }
  if (const char* env = std::getenv("LLAMA_SERVER_KVSHARE"); env != nullptr && *env != '\0') {
    s.backend = env;
    return;
  }
  std::stringstream path(std::getenv("PATH") ? std::getenv("PATH") : "");
  for (std::string dir; std::getline(path, dir, ':');) {
    if (dir.empty()) continue;
    const fs::path candidate = fs::path(dir) / "llama-server";
    if (is_executable(candidate) && is_executable(fs::path(dir) / "llama-kvshare-prefill")) {
      s.backend = candidate;
      return;
    }
  }
  s.backend_why =
      "no patched llama-server: pass --backend PATH or set LLAMA_SERVER_KVSHARE (none on PATH has "
      "llama-kvshare-prefill beside it)";
}

// Why `config` cannot run at all ("" when it can be started).
std::string config_not_run(const Config& config) {
  const Settings& s = settings();
  if (!config.kvshare_decoder && !s.backend_why.empty()) return s.backend_why;
  if (is_resident(config.route)) {
    const std::string& why = config.kvshare_decoder ? s.decoder_resident_why : s.resident_why;
    if (!why.empty()) return why;
  }
  return "";
}

// The serves, started on the first benchmark and stopped after the report.
struct Setup {
  fs::path dir;
  fs::path model;
  std::map<std::string, std::unique_ptr<ServeUnderTest>> serves;  // by Config::key
  std::map<std::string, std::string> not_run;                     // by Config::key: why
  std::string why;                                                // non-empty: nothing runs
  int tokenizer_port = 0;
  int salt = 0;
  size_t turn = 0;  // the rotation, across rounds and client counts
  bool started = false;
};

Setup& setup_state() {
  static Setup s;
  return s;
}

std::unique_ptr<ServeUnderTest> start_config(const Config& config, const Setup& made, std::string& why) {
  const Settings& s = settings();
  const fs::path backend = config.kvshare_decoder ? bin("kvshare-decoder") : s.backend;
  const fs::path provider = config.kvshare_decoder ? bin("kvshare-prefill") : s.provider;
  ServeLaunch launch;
  launch.name = config.key;
  std::replace(launch.name.begin(), launch.name.end(), '/', '-');
  if (config.kvshare_decoder) launch.name = "kvshare-decoder-" + launch.name;
  launch.args = {"-m",        made.model.string(),
                 "--device",  config.hybrid ? "hybrid" : "cpu",
                 "--backend", backend.string(),
                 "-c",        std::to_string(s.n_ctx),
                 "-fa",       "on",
                 "-ctk",      "f16",
                 "-ctv",      "f16",
                 "-np",       std::to_string(config.np)};
  if (config.hybrid) {
    launch.args.insert(launch.args.end(),
                       {"--prefill-provider", provider.string(), "--handoff", "always", "--provider-timeout", "1800"});
    if (is_resident(config.route)) launch.args.push_back("--provider-resident");
  }
  if (config.kv_unified) launch.args.insert(launch.args.end(), {"--", "-kvu"});
  launch.kv_share = config.hybrid && handoff_of(config.route) == "shared";
  auto serve = kvshare::bench::start_serve(launch, made.dir, why);
  if (!serve) {
    const std::string line = last_log_line(made.dir / ("serve-" + launch.name + ".log"));
    if (!line.empty()) why += ": " + line;
  }
  return serve;
}

struct Reply {
  double first_byte_ms = 0;
  double total_ms = 0;
  int tokens = 0;  // generated, as the reply says
};

struct Phase {
  double wall_s = 0;
  std::vector<Reply> replies;  // the completed ones
  int errors = 0;
  std::string first_error;
  int handed_off = 0;  // serve's hybrid: lines of a handoff during the phase
  int forwarded = 0;   // ... and of a forwarded request
};

int count_matches(const std::string& text, const std::regex& re) {
  return static_cast<int>(std::distance(std::sregex_iterator(text.begin(), text.end(), re), std::sregex_iterator()));
}

// One streamed completion; an error message instead of a reply when it did not come whole.
Result<Reply> one_request(int port, const std::string& prompt, int n_predict) {
  auto streamed = stream_completion(port, prompt, n_predict);
  if (!streamed) return tl::unexpected(streamed.error());
  Reply reply;
  reply.first_byte_ms = streamed->first_byte_ms;
  reply.total_ms = streamed->total_ms;
  const std::string& body = streamed->body;
  // The tokens generated: the last event's usage.completion_tokens, else the events that
  // do not finish the reply.
  int events = 0, usage = -1;
  std::stringstream lines(body);
  for (std::string line; std::getline(lines, line);) {
    if (!line.starts_with("data: ") || line.starts_with("data: [DONE]")) continue;
    const auto event = nlohmann::json::parse(line.substr(6), nullptr, false);
    if (event.is_discarded()) continue;
    if (event.contains("usage") && event["usage"].contains("completion_tokens"))
      usage = event["usage"]["completion_tokens"].get<int>();
    const bool finishes = event.contains("choices") && !event["choices"].empty() &&
                          event["choices"][0].contains("finish_reason") &&
                          !event["choices"][0]["finish_reason"].is_null();
    if (!finishes) ++events;
  }
  reply.tokens = usage >= 0 ? usage : events;
  if (reply.tokens == 0) return fail(EPROTO, "a reply without one token: {}", body.substr(0, 200));
  return reply;
}

// `prompts[c]` are client c's requests, in order; every client starts at once.
Phase run_phase(ServeUnderTest& serve, const std::vector<std::vector<std::string>>& prompts) {
  const int n_predict = settings().n_predict;
  const size_t log_before = read_all(serve.stderr_path).size();
  Phase phase;
  std::mutex mutex;
  std::vector<std::thread> clients;
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  for (const auto& mine : prompts)
    clients.emplace_back([&, &mine = mine] {
      ++ready;
      while (!go.load()) std::this_thread::yield();
      for (const std::string& prompt : mine) {
        auto reply = one_request(serve.port, prompt, n_predict);
        std::lock_guard lock(mutex);
        if (reply) {
          phase.replies.push_back(*reply);
        } else {
          if (phase.errors++ == 0) phase.first_error = reply.error().what();
        }
      }
    });
  while (ready.load() < static_cast<int>(prompts.size())) std::this_thread::yield();
  const auto start = Clock::now();
  go = true;
  for (std::thread& client : clients) client.join();
  phase.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  // Serve writes its hybrid: line before the first byte; the pipe to the file may lag.
  static const std::regex handed_re(R"(hybrid: \d+ prompt tokens[^\n]*: prefill [\d.]+ ms)");
  static const std::regex forwarded_re(R"(hybrid: \d+ prompt tokens[^\n]*: forwarded)");
  size_t requests = 0;
  for (const auto& mine : prompts) requests += mine.size();
  for (int i = 0; i < 100; ++i) {
    const std::string log = read_all(serve.stderr_path);
    const std::string fresh = log.size() > log_before ? log.substr(log_before) : std::string();
    phase.handed_off = count_matches(fresh, handed_re);
    phase.forwarded = count_matches(fresh, forwarded_re);
    if (static_cast<size_t>(phase.handed_off + phase.forwarded) >= requests) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return phase;
}

void stop_setup() {
  Setup& s = setup_state();
  s.serves.clear();
  std::error_code ec;
  if (!s.dir.empty()) fs::remove_all(s.dir, ec);
  s = Setup{};
}

// The first error text per "clients/config" (a counter holds only numbers).
std::map<std::string, std::string>& error_lines() {
  static std::map<std::string, std::string> lines;
  return lines;
}

Setup& setup() {
  Setup& made = setup_state();
  if (made.started) return made;
  made.started = true;
  const Settings& s = settings();
  std::vector<fs::path> programs = {bin("kvshare-decoder"), bin("kvshare-prefill")};
  auto model = make_bench_model("kvshare-bench-load", programs, made.why, {}, s.n_ctx);
  if (!model) return made;
  made.dir = model->dir;
  made.model = model->model;
  for (const Config& config : s.configs) {
    if (const std::string why = config_not_run(config); !why.empty()) {
      made.not_run[config.key] = why;
      continue;
    }
    std::string why;
    auto serve = start_config(config, made, why);
    if (!serve) {
      made.not_run[config.key] = why;
      continue;
    }
    // One untimed request: every decoder allocates some buffers on its first one, and a
    // resident provider is sent the region on its first shared request.
    const route::DecoderClient decoder("127.0.0.1", serve->decoder_port, std::chrono::seconds(120));
    if (auto warm = one_request(serve->port, prompt_of(decoder, std::min(64, s.tokens), 0), 2); !warm) {
      made.not_run[config.key] = fmt::format("warm-up request failed: {}; serve's last line: {}", warm.error().what(),
                                             last_log_line(serve->stderr_path));
      continue;
    }
    // Any running serve's decoder tokenizes the prompts: they all load the same model.
    if (made.tokenizer_port == 0) made.tokenizer_port = serve->decoder_port;
    made.serves[config.key] = std::move(serve);
  }
  if (made.serves.empty()) made.why = "no configuration started (see the lines on what was not run)";
  return made;
}

void bm_clients(benchmark::State& state) {
  const int n_clients = static_cast<int>(state.range(0));
  const Settings& st = settings();
  Setup& s = setup();
  if (!s.why.empty()) return state.SkipWithError(s.why.c_str());
  std::vector<std::string> keys;  // running, in report order
  for (const Config& config : st.configs)
    if (s.serves.count(config.key)) keys.push_back(config.key);
  const route::DecoderClient decoder("127.0.0.1", s.tokenizer_port, std::chrono::seconds(120));
  std::map<std::string, std::vector<double>> rps, first_byte, total, tokens;
  std::map<std::string, double> errors, handed_off, forwarded, requests;
  std::map<std::string, std::vector<double>> ratio;  // route -> hybrid-np4 / hybrid-np1 per round
  for (auto _ : state) {
    // The same prompts for every configuration; fresh salts every round.
    std::vector<std::vector<std::string>> prompts(n_clients);
    for (auto& mine : prompts)
      for (int r = 0; r < st.requests_per_client; ++r) mine.push_back(prompt_of(decoder, st.tokens, ++s.salt));
    std::map<std::string, double> round_rps;
    double round_s = 0;
    for (size_t k = 0; k < keys.size(); ++k) {
      const std::string& key = keys[(s.turn + k) % keys.size()];
      const Phase phase = run_phase(*s.serves[key], prompts);
      round_s += phase.wall_s;
      const double done = static_cast<double>(phase.replies.size());
      round_rps[key] = phase.wall_s > 0 ? done / phase.wall_s : 0;
      rps[key].push_back(round_rps[key]);
      for (const Reply& r : phase.replies) {
        first_byte[key].push_back(r.first_byte_ms);
        total[key].push_back(r.total_ms);
        tokens[key].push_back(r.tokens);
      }
      requests[key] += static_cast<double>(phase.replies.size()) + phase.errors;
      errors[key] += phase.errors;
      handed_off[key] += phase.handed_off;
      forwarded[key] += phase.forwarded;
      if (phase.errors > 0) {
        auto& line = error_lines()[fmt::format("{}/{}", n_clients, key)];
        if (line.empty()) line = phase.first_error;
      }
    }
    ++s.turn;
    for (const char* route : kRouteChoices) {
      const std::string np4 = fmt::format("hybrid-np4/{}", route), np1 = fmt::format("hybrid-np1/{}", route);
      if (round_rps.count(np4) && round_rps.count(np1) && round_rps[np1] > 0)
        ratio[route].push_back(round_rps[np4] / round_rps[np1]);
    }
    state.SetIterationTime(round_s);
  }
  for (const std::string& key : keys) {
    const std::string p = key + ".";
    record_spread(state, p + "rps", rps[key]);
    state.counters[p + "first_byte_p50"] = percentile(first_byte[key], 0.5);
    state.counters[p + "first_byte_p99"] = percentile(first_byte[key], 0.99);
    state.counters[p + "total_p50"] = percentile(total[key], 0.5);
    state.counters[p + "total_p99"] = percentile(total[key], 0.99);
    state.counters[p + "tokens_p50"] = percentile(tokens[key], 0.5);
    state.counters[p + "requests"] = requests[key];
    state.counters[p + "errors"] = errors[key];
    state.counters[p + "handed_off"] = handed_off[key];
    state.counters[p + "forwarded"] = forwarded[key];
  }
  for (const auto& [route, values] : ratio) record_spread(state, "ratio." + route, values);
  state.counters["clients"] = n_clients;
  state.counters["rounds"] = static_cast<double>(state.iterations());
}

void register_all(const BenchArgs& args) {
  Settings& s = settings();
  s = Settings{};
  std::string backend_given;
  fs::path provider_given;
  std::vector<std::string> configs_asked, routes_asked;
  bool clients_given = false, requests_given = false, rounds_given = false, n_predict_given = false;
  for (size_t i = 0; i + 1 < args.rest.size(); ++i) {
    const std::string& flag = args.rest[i];
    if (flag == "--backend")
      backend_given = args.rest[++i];
    else if (flag == "--provider")
      provider_given = args.rest[++i];
    else if (flag == "--configs")
      configs_asked = split_list(args.rest[++i]);
    else if (flag == "--routes")
      routes_asked = split_list(args.rest[++i]);
    else if (flag == "--rounds")
      s.rounds = std::max(1, std::atoi(args.rest[++i].c_str())), rounds_given = true;
    else if (flag == "--requests-per-client")
      s.requests_per_client = std::max(1, std::atoi(args.rest[++i].c_str())), requests_given = true;
    else if (flag == "--n-predict")
      s.n_predict = std::max(1, std::atoi(args.rest[++i].c_str())), n_predict_given = true;
    else if (flag == "--clients") {
      for (const std::string& item : split_list(args.rest[++i]))
        s.clients.push_back(std::max(1, std::atoi(item.c_str())));
      clients_given = true;
    }
  }
  // --smoke: a check that the group runs (well under 20 s), not a measurement.
  if (!clients_given) s.clients = args.smoke ? std::vector<int>{1, 2} : std::vector<int>{1, 4, 16};
  std::sort(s.clients.begin(), s.clients.end());
  s.clients.erase(std::unique(s.clients.begin(), s.clients.end()), s.clients.end());
  if (args.smoke && !requests_given) s.requests_per_client = 1;
  if (args.smoke && !rounds_given) s.rounds = 1;
  if (args.smoke && !n_predict_given) s.n_predict = 2;
  s.tokens = args.tokens.front();
  if (args.tokens.size() > 1) s.extra_tokens.assign(args.tokens.begin() + 1, args.tokens.end());
  find_backend(s, backend_given);
  s.provider = !provider_given.empty() ? provider_given
               : !s.backend.empty()    ? s.backend.parent_path() / "llama-kvshare-prefill"
                                       : fs::path();
  if (!s.backend.empty() && !fs::exists(s.backend))
    s.backend_why = fmt::format("{} does not exist", s.backend.string());
  else if (!s.backend.empty() && !fs::exists(s.provider))
    s.backend_why = fmt::format("{} (the llama-server configurations' provider) does not exist", s.provider.string());
  if (routes_asked.empty()) routes_asked = {"shared"};
  if (configs_asked.empty()) configs_asked.assign(std::begin(kDefaultConfigs), std::end(kDefaultConfigs));
  bool any_resident = false;
  for (const std::string& r : routes_asked) any_resident |= is_resident(r);
  if (any_resident && s.backend_why.empty()) s.resident_why = resident_support(s.provider);
  if (any_resident) s.decoder_resident_why = resident_support(bin("kvshare-prefill"));
  int max_np = 1;
  for (const char* choice : kConfigChoices) {
    if (std::find(configs_asked.begin(), configs_asked.end(), choice) == configs_asked.end()) continue;
    const std::string name = choice;
    Config config;
    config.choice = name;
    config.kvshare_decoder = name.starts_with("decoder");
    config.hybrid = !name.starts_with("cpu");
    config.np = name.find("np4") != std::string::npos ? 4 : 1;
    config.kv_unified = name.ends_with("-kvu");
    max_np = std::max(max_np, config.np);
    if (!config.hybrid) {
      config.key = name;
      s.configs.push_back(config);
      continue;
    }
    for (const char* route : kRouteChoices) {
      if (std::find(routes_asked.begin(), routes_asked.end(), route) == routes_asked.end()) continue;
      config.route = route;
      config.key = name + "/" + route;
      s.configs.push_back(config);
    }
  }
  // llama-server splits -c between its slots: each holds a prompt and its reply.
  s.n_ctx = std::max(8192, (s.tokens + s.n_predict + 16) * max_np / 256 * 256 + 256);
  for (int n_clients : s.clients)
    benchmark::RegisterBenchmark(fmt::format("load/clients:{}", n_clients).c_str(), bm_clients)
        ->Arg(n_clients)
        ->Iterations(s.rounds)
        ->UseManualTime()
        ->Unit(benchmark::kSecond);
}

const Config* config_of(const std::string& key) {
  for (const Config& config : settings().configs)
    if (config.key == key) return &config;
  return nullptr;
}

int report(const std::vector<RunResult>& runs, const BenchArgs& args) {
  const Settings& st = settings();
  Setup& s = setup_state();
  if (!args.json) {
    fmt::print(
        "\nload ({} concurrent clients in a closed loop, {} request(s) each, prompts of {} tokens, max_tokens {} "
        "streamed; generated model, -c {} -fa on f16, --handoff always; rounds of {} with the order rotating)\n",
        fmt::join(st.clients, ","), st.requests_per_client, st.tokens, st.n_predict, st.n_ctx, st.rounds);
    fmt::print("llama-server: {}; provider {}\n", st.backend.empty() ? "none" : st.backend.string(),
               st.provider.empty() ? "-" : st.provider.string());
    fmt::print("{:>7} {:<15} {:<24} {:>22} {:>10} {:>10} {:>10} {:>10} {:>7} {:>10} {:>6}\n", "clients", "decoder",
               "configuration", "requests/s [p25..p75]", "fb p50 ms", "fb p99 ms", "total p50", "total p99", "gen",
               "handed off", "errors");
  }
  struct Ratio {
    int clients;
    std::string route;
    Spread spread;
  };
  std::vector<Ratio> ratios;
  std::vector<std::string> notes;
  for (const RunResult* run : runs_with_prefix(runs, "load/")) {
    auto c = [&](const std::string& key) { return run->counters.count(key) ? run->counters.at(key) : 0.0; };
    auto has = [&](const std::string& key) { return run->counters.count(key) > 0; };
    const int clients = static_cast<int>(c("clients"));
    if (clients == 0) continue;
    for (const Config& config : st.configs) {
      const std::string p = config.key + ".";
      if (!has(p + "requests")) continue;
      const std::string error_line = error_lines()[fmt::format("{}/{}", clients, config.key)];
      if (c(p + "errors") > 0)
        notes.push_back(fmt::format("{} clients, {} ({}): {} of {} requests failed, the first: {}", clients,
                                    config.label(), config.decoder_name(), c(p + "errors"), c(p + "requests"),
                                    error_line));
      if (config.hybrid && c(p + "forwarded") > 0)
        notes.push_back(fmt::format("{} clients, {} ({}): serve forwarded {} of {} requests (no handoff)", clients,
                                    config.label(), config.decoder_name(), c(p + "forwarded"), c(p + "requests")));
      if (args.json) {
        fmt::print(
            "{{\"bench\":\"load\",\"config\":\"{}\",\"decoder\":\"{}\",\"device\":\"{}\",\"np\":{},"
            "\"route\":\"{}\",\"clients\":{},\"requests_per_client\":{},\"rounds\":{},\"tokens\":{},"
            "\"kv_unified\":{},\"n_predict\":{},\"rps\":{:.4f},\"rps_p25\":{:.4f},\"rps_p75\":{:.4f},"
            "\"first_byte_ms_p50\":{:.3f},\"first_byte_ms_p99\":{:.3f},\"total_ms_p50\":{:.3f},"
            "\"total_ms_p99\":{:.3f},\"tokens_per_reply\":{},\"requests\":{},\"errors\":{},\"handed_off\":{},"
            "\"forwarded\":{}",
            config.key, config.decoder_name(), config.hybrid ? "hybrid" : "cpu", config.np,
            config.route.empty() ? "cpu" : config.route, clients, st.requests_per_client, c("rounds"), st.tokens,
            config.kv_unified, st.n_predict, c(p + "rps"), c(p + "rps_p25"), c(p + "rps_p75"), c(p + "first_byte_p50"),
            c(p + "first_byte_p99"), c(p + "total_p50"), c(p + "total_p99"), c(p + "tokens_p50"), c(p + "requests"),
            c(p + "errors"), c(p + "handed_off"), c(p + "forwarded"));
        if (!error_line.empty()) fmt::print(",\"error\":{}", nlohmann::json(error_line).dump());
        fmt::print("}}\n");
        continue;
      }
      fmt::print("{:>7} {:<15} {:<24} {:>22} {:>10.1f} {:>10.1f} {:>10.1f} {:>10.1f} {:>7} {:>10} {:>6}\n", clients,
                 config.decoder_name(), config.label(),
                 fmt::format("{:.2f} [{:.2f}..{:.2f}]", c(p + "rps"), c(p + "rps_p25"), c(p + "rps_p75")),
                 c(p + "first_byte_p50"), c(p + "first_byte_p99"), c(p + "total_p50"), c(p + "total_p99"),
                 c(p + "tokens_p50"),
                 config.hybrid ? fmt::format("{}/{}", c(p + "handed_off"), c(p + "requests")) : std::string("-"),
                 c(p + "errors"));
    }
    for (const char* route : kRouteChoices)
      if (has(std::string("ratio.") + route))
        ratios.push_back({clients,
                          route,
                          {c(std::string("ratio.") + route + "_p25"), c(std::string("ratio.") + route),
                           c(std::string("ratio.") + route + "_p75")}});
  }
  // The ratio at the most clients run, per route; said so also when a side did not run.
  const int most = st.clients.empty() ? 0 : st.clients.back();
  std::vector<std::string> ratio_lines;
  for (const char* route : kRouteChoices) {
    const std::string np4 = fmt::format("hybrid-np4/{}", route), np1 = fmt::format("hybrid-np1/{}", route);
    if (!config_of(np4) || !config_of(np1)) continue;
    auto measured = std::find_if(ratios.begin(), ratios.end(),
                                 [&](const Ratio& r) { return r.clients == most && r.route == route; });
    if (measured != ratios.end()) {
      const Spread& r = measured->spread;
      ratio_lines.push_back(fmt::format(
          "hybrid -np 4 / hybrid -np 1 requests/s at {} clients = {:.2f} [{:.2f}..{:.2f}] per round ({} route, "
          "llama-server; target >= 1.5: {})",
          most, r.median, r.p25, r.p75, route, r.median >= 1.5 ? "met" : "missed"));
      if (args.json)
        fmt::print(
            "{{\"bench\":\"load_ratio\",\"route\":\"{}\",\"clients\":{},\"ratio\":{:.4f},\"ratio_p25\":{:.4f},"
            "\"ratio_p75\":{:.4f}}}\n",
            route, most, r.median, r.p25, r.p75);
    } else {
      const std::string why = s.not_run.count(np4)   ? "hybrid -np 4 not run"
                              : s.not_run.count(np1) ? "hybrid -np 1 not run"
                                                     : "not measured";
      ratio_lines.push_back(fmt::format(
          "hybrid -np 4 / hybrid -np 1 requests/s at {} clients = - ({} route: {}; target >= 1.5)", most, route, why));
    }
  }
  for (const Config& config : st.configs)
    if (s.not_run.count(config.key)) {
      if (args.json)
        fmt::print("{{\"bench\":\"load_not_run\",\"config\":\"{}\",\"decoder\":\"{}\",\"why\":{}}}\n", config.key,
                   config.decoder_name(), nlohmann::json(s.not_run.at(config.key)).dump());
      else
        fmt::print("{} ({}) not run: {}\n", config.label(), config.decoder_name(), s.not_run.at(config.key));
    }
  if (!args.json) {
    for (const std::string& note : notes) fmt::print("{}\n", note);
    if (!st.extra_tokens.empty())
      fmt::print("--tokens: only the first length ({}) is run; {} not run\n", st.tokens,
                 fmt::join(st.extra_tokens, ","));
    fmt::print(
        "(fb: first byte of the streamed reply; total: the whole reply; gen: tokens generated per reply, median, "
        "as the reply says; requests/s: completed requests / the phase's wall time, per round)\n");
    for (const std::string& line : ratio_lines) fmt::print("{}\n", line);
  }
  stop_setup();
  return 0;
}

const bool registered = add_group({
    "load",
    "many users at once (issue 27): C concurrent clients in a closed loop through kvshare-serve --device cpu -np 4, "
    "hybrid -np 1 and -np 4 (patched llama-server) and hybrid -np 1 (kvshare-decoder), paired rounds on the same "
    "prompts: requests/s, first byte p50/p99, whole reply p50; --tokens T sets the prompt length (default 300)",
    register_all,
    report,
    {
        {"--backend", "PATH",
         "the patched llama-server (default $LLAMA_SERVER_KVSHARE, else one on PATH with llama-kvshare-prefill "
         "beside it)"},
        {"--provider", "PATH", "the llama-server configurations' provider (default llama-kvshare-prefill beside it)"},
        {"--configs", "cpu-np1|cpu-np4|hybrid-np1|hybrid-np4|hybrid-np4-kvu|decoder-np1[,...]",
         "the serves measured side by side (default cpu-np4,hybrid-np1,hybrid-np4,decoder-np1; decoder-np1 is "
         "kvshare-decoder, the others the patched llama-server; -kvu: a unified cache)"},
        {"--routes", "shared|file|shared_resident|file_resident[,...]",
         "the hybrid configurations' routes, each a serve of its own (default shared)"},
        {"--clients", "N[,...]", "concurrent clients per phase, each a closed loop (default 1,4,16; smoke 1,2)"},
        {"--requests-per-client", "N", "requests each client sends, one after the other (default 4; smoke 1)"},
        {"--n-predict", "N", "tokens generated per request, ignore_eos on (default 16; smoke 2)"},
        {"--rounds", "N", "rounds per client count, one phase per configuration each, order rotating (default 3)"},
    },
    {300},
    {16},
});

}  // namespace
}  // namespace kvshare::bench
