// kvshare-bench route: end-to-end time to first byte through kvshare-serve for prompts of
// 307 and 4096 tokens on a generated model, three ways in one run: --device cpu (the
// decoder prefills), the file route and the shared route (kvshare-prefill + kvshare-decoder).
// The handoff column is serve's own figure from its `hybrid:` line (restore, or share +
// adopt): the shared route's must stay flat as the prompt grows, the file route's grows
// with the bytes of KV.
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <thread>

#include "bench_registry.h"
#include "kvshare/share/spawn.h"
#include "kvshare/route/decoder_client.h"
#include "kvshare/route/decoder_process.h"
#include "kvshare/route/upstream_stream.h"

namespace kvshare::bench {
namespace {

namespace fs = std::filesystem;
using kvshare::ChildProcess;
using Clock = std::chrono::steady_clock;

fs::path bin(const std::string& name) { return fs::path(KVSHARE_BIN_DIR) / name; }

std::string read_all(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// One kvshare-serve for a route, started once per benchmark case.
struct ServeUnderTest {
  ChildProcess process;
  fs::path stderr_path;
  int port = 0;
  int decoder_port = 0;
  ~ServeUnderTest() { process.terminate(std::chrono::seconds(10)); }
};

std::unique_ptr<ServeUnderTest> start_serve(const std::string& route, const fs::path& model, const fs::path& dir) {
  auto serve = std::make_unique<ServeUnderTest>();
  auto port = route::pick_free_loopback_port();
  if (!port) return nullptr;
  serve->port = *port;
  serve->stderr_path = dir / ("serve-" + route + ".log");
  std::vector<std::string> argv = {bin("kvshare-serve").string(), "-m", model.string(), "--device",
                                   route == "cpu" ? "cpu" : "hybrid", "--backend", bin("kvshare-decoder").string(),
                                   "--port", std::to_string(serve->port), "-c", "8192", "-fa", "on"};
  if (route != "cpu") argv.insert(argv.end(), {"--prefill-provider", bin("kvshare-prefill").string()});
  if (route == "shared") ::setenv("ONEBIT_KV_SHARE", "1", 1);
  else ::unsetenv("ONEBIT_KV_SHARE");
  SpawnOptions options;
  options.stderr_path = serve->stderr_path.string();
  options.die_with_parent = true;
  auto child = ChildProcess::spawn(argv, options);
  ::unsetenv("ONEBIT_KV_SHARE");
  if (!child) return nullptr;
  serve->process = std::move(*child);
  const std::regex decoder_re(R"(decoder \S+ on 127\.0\.0\.1:(\d+))");
  for (int i = 0; i < 1200; ++i) {
    std::smatch match;
    const std::string log = read_all(serve->stderr_path);
    if (std::regex_search(log, match, decoder_re)) {
      serve->decoder_port = std::stoi(match[1]);
      return serve;
    }
    if (serve->process.poll_exit()) return nullptr;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return nullptr;
}

// A prompt text the decoder tokenizes to exactly `n_tokens` (BOS included), starting with
// `salt` so that no two requests share a cached prefix.
std::string prompt_of(const route::DecoderClient& decoder, int n_tokens, int salt) {
  std::string text = fmt::format("{} ", salt);
  const char* words[] = {"alpha ", "beta ", "gamma ", "delta ", "x", "y "};
  size_t w = 0;
  while (true) {
    auto ids = decoder.tokenize(text);
    if (!ids || static_cast<int>(ids->size()) >= n_tokens) break;
    const size_t missing = static_cast<size_t>(n_tokens) - ids->size();
    // Add many words at once while far away, one at a time near the target.
    for (size_t k = 0; k < std::max<size_t>(1, missing / 3); ++k) text += words[w++ % 6];
  }
  while (true) {
    auto ids = decoder.tokenize(text);
    if (!ids || static_cast<int>(ids->size()) <= n_tokens) break;
    text.pop_back();
  }
  return text;
}

// handoff ms of the newest `hybrid:` line in serve's log.
double last_handoff_ms(const fs::path& log_path) {
  const std::regex line_re(R"(hybrid: \d+ prompt tokens: prefill [\d.]+ ms, (?:share|restore) ([\d.]+) ms,)");
  const std::string log = read_all(log_path);
  double ms = 0;
  for (std::sregex_iterator it(log.begin(), log.end(), line_re), end; it != end; ++it) ms = std::stod((*it)[1]);
  return ms;
}

struct Setup {
  fs::path dir;
  fs::path model;
  bool ok = false;
  std::string why;
};

Setup& setup() {
  static Setup s = [] {
    Setup made;
    for (const char* tool : {"kvshare-serve", "kvshare-decoder", "kvshare-prefill", "kvshare-mkmodel"})
      if (!fs::exists(bin(tool))) {
        made.why = fmt::format("{} not built", tool);
        return made;
      }
    auto dir = route::make_private_dir("kvshare-bench-route");
    if (!dir) {
      made.why = dir.error().what();
      return made;
    }
    made.dir = *dir;
    made.model = made.dir / "tiny.gguf";
    const std::string command = fmt::format("{} {} --ctx 8192 --seed 3 > /dev/null 2>&1", bin("kvshare-mkmodel").string(),
                                            made.model.string());
    made.ok = std::system(command.c_str()) == 0;
    if (!made.ok) made.why = "kvshare-mkmodel failed";
    return made;
  }();
  return s;
}

void bm_route(benchmark::State& state, std::string route_name) {
  Setup& s = setup();
  if (!s.ok) {
    state.SkipWithError(s.why.c_str());
    return;
  }
  const int n_tokens = static_cast<int>(state.range(0));
  auto serve = start_serve(route_name, s.model, s.dir);
  if (!serve) {
    state.SkipWithError(("kvshare-serve did not start for route " + route_name).c_str());
    return;
  }
  const route::DecoderClient decoder("127.0.0.1", serve->decoder_port, std::chrono::seconds(120));
  int salt = 0;
  double first_byte_total_ms = 0, handoff_total_ms = 0;
  for (auto _ : state) {
    state.PauseTiming();
    const std::string prompt = prompt_of(decoder, n_tokens, ++salt);
    state.ResumeTiming();
    route::UpstreamStream::Request request;
    request.host = "127.0.0.1";
    request.port = serve->port;
    request.method = "POST";
    request.path = "/v1/completions";
    request.body = nlohmann::json{{"prompt", prompt}, {"max_tokens", 1}, {"temperature", 0}, {"stream", true}}.dump();
    const auto start = Clock::now();
    auto stream = route::UpstreamStream::start(request, nullptr);
    std::string piece;
    const bool got = stream->wait_head().has_value() && stream->next(piece);
    const double first_byte_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    while (stream->next(piece)) {
    }
    stream.reset();
    if (!got) {
      state.SkipWithError("no reply from kvshare-serve");
      return;
    }
    state.PauseTiming();
    // The log line is written before the first byte goes out; give the pipe a moment.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    first_byte_total_ms += first_byte_ms;
    handoff_total_ms += route_name == "cpu" ? 0.0 : last_handoff_ms(serve->stderr_path);
    state.ResumeTiming();
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["first_byte_ms"] = first_byte_total_ms / n;
  state.counters["handoff_ms"] = handoff_total_ms / n;
  state.counters["tokens"] = n_tokens;
}

const bool registered = add_group({
    "route",
    "kvshare-serve end to end: time to first byte for --device cpu, the file route and the shared route "
    "(generated model, kvshare-prefill + kvshare-decoder), with serve's own handoff figure",
    [](const BenchArgs& args) {
      std::vector<int> tokens = args.tokens;
      if (tokens.empty()) tokens = args.smoke ? std::vector<int>{16} : std::vector<int>{307, 4096};
      for (const char* route_name : {"cpu", "file", "shared"}) {
        auto* bench = benchmark::RegisterBenchmark(fmt::format("route/{}", route_name).c_str(), bm_route,
                                                   std::string(route_name));
        for (int n : tokens) bench->Arg(n);
        bench->Iterations(args.smoke ? 1 : 5)->Unit(benchmark::kMillisecond);
      }
    },
    [](const std::vector<RunResult>& runs, const BenchArgs& args) {
      if (!args.json)
        fmt::print("{:<8} {:>7} {:>15} {:>12}\n", "route", "tokens", "first_byte_ms", "handoff_ms");
      for (const RunResult* run : runs_with_prefix(runs, "route/")) {
        const std::string name = run->name.substr(6, run->name.find('/', 6) - 6);
        auto counter = [&](const char* key) { return run->counters.count(key) ? run->counters.at(key) : 0.0; };
        const int tokens = static_cast<int>(counter("tokens"));
        if (tokens == 0) continue;  // skipped (tools missing): nothing measured
        if (args.json)
          fmt::print("{{\"bench\":\"route\",\"route\":\"{}\",\"tokens\":{},\"first_byte_ms\":{:.3f},\"handoff_ms\":{:.3f}}}\n",
                     name, tokens, counter("first_byte_ms"), counter("handoff_ms"));
        else
          fmt::print("{:<8} {:>7} {:>15.3f} {:>12.3f}\n", name, tokens, counter("first_byte_ms"), counter("handoff_ms"));
      }
      std::error_code ec;
      if (!setup().dir.empty()) fs::remove_all(setup().dir, ec);
      return 0;
    },
});

}  // namespace
}  // namespace kvshare::bench
