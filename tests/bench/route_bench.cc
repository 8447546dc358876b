// kvshare-bench route: what each route adds to the time to first byte through
// kvshare-serve, for prompts of 307 and 4096 tokens on a generated model. Four serves run
// side by side (--device cpu, the file route, the shared route and the remote route, each
// with its own decoder; the remote one prefilled by a kvshare-provider-server on loopback,
// its rows over UCX tcp into serve's kvshare-remote-receiver)
// and every round sends the same fresh prompt to each, the order rotating from round to
// round, so a slow moment of the machine falls on every route alike.
//
// Per request: first_byte_ms (measured here), and from serve's `hybrid:` line the
// provider's own prefill_ms and serve's handoff_ms (restore, or share + adopt).
// overhead_ms = first_byte_ms - prefill_ms is what the route adds to the provider's work:
// starting the provider and loading the model, the handoff, the decoder's one-token step,
// the HTTP hops. The 2-second spread of a CPU prefill drowns a 6 ms handoff in first_byte_ms;
// overhead_ms takes the prefill out, request by request.
//
// The decoder is kvshare-decoder (with kvshare-prefill as the provider) unless
// --backend PATH names another, such as a llama-server built with the patch series of
// integrations/llama.cpp; its provider is then llama-kvshare-prefill beside it (or
// --provider PATH), so that both run the same llama.cpp.
// Group flags (after --, or before it for these two): --backend PATH, --provider PATH;
// --rounds N (default 9).
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <sstream>
#include <thread>

#include "bench_files.h"
#include "bench_registry.h"
#include "bench_serve.h"
#include "bench_stats.h"
#include "kvshare/route/decoder_client.h"
#include "kvshare/route/decoder_process.h"
#include "kvshare/route/upstream_stream.h"
#include "kvshare/share/spawn.h"

namespace kvshare::bench {
namespace {

namespace fs = std::filesystem;
using kvshare::ChildProcess;
using Clock = std::chrono::steady_clock;


const char* const kRoutes[] = {"cpu", "file", "shared", "remote"};
// The remote route's provider server and its deployment key (the same for the run).
constexpr const char* kRemoteKey = "kvshare-bench-route-key";

struct Settings {
  fs::path backend;   // the decoder binary
  fs::path provider;  // the prefill provider
  bool is_llama_server = false;
  int rounds = 9;
};

Settings& settings() {
  static Settings s;
  return s;
}

// One kvshare-serve per route, started once per run and stopped at exit.
std::unique_ptr<ServeUnderTest> start_serve(const std::string& route, const fs::path& model, const fs::path& dir,
                                            const std::string& remote_url, std::string& why) {
  ServeLaunch launch;
  launch.name = route;
  launch.args = {"-m", model.string(), "--device", route == "cpu" ? "cpu" : "hybrid", "--backend",
                 settings().backend.string(), "-c", "8192", "-fa", "on", "-ctk", "f16", "-ctv", "f16"};
  if (route == "remote") launch.args.insert(launch.args.end(), {"--prefill-remote", remote_url});
  else if (route != "cpu") launch.args.insert(launch.args.end(), {"--prefill-provider", settings().provider.string()});
  // The bench measures the handoff itself: every prompt takes it.
  if (route != "cpu") launch.args.insert(launch.args.end(), {"--handoff", "always"});
  launch.kv_share = route == "shared";
  launch.env = {std::string("KVSHARE_REMOTE_KEY=") + kRemoteKey, "UCX_TLS=tcp"};
  return kvshare::bench::start_serve(launch, dir, why);
}

// Serve's `hybrid:` lines: the provider's prefill and serve's handoff, per request.
struct HybridLine {
  double prefill_ms = 0;
  double handoff_ms = 0;
  std::string route;  // "file", "shared" or "remote"
};

std::vector<HybridLine> hybrid_lines(const fs::path& log_path) {
  const std::regex line_re(
      R"(hybrid: \d+ prompt tokens(?:, \d+ cached)?: prefill ([\d.]+) ms(?: of \d+ tokens)?, (share ([\d.]+) ms( remote)?, )?(restore ([\d.]+) ms, )?first byte)");
  const std::string log = read_all(log_path);
  std::vector<HybridLine> lines;
  for (std::sregex_iterator it(log.begin(), log.end(), line_re), end; it != end; ++it) {
    HybridLine line;
    line.prefill_ms = std::stod((*it)[1]);
    line.route = (*it)[4].matched ? "remote" : (*it)[3].matched && !(*it)[6].matched ? "shared" : "file";
    line.handoff_ms = (*it)[6].matched ? std::stod((*it)[6]) : (*it)[3].matched ? std::stod((*it)[3]) : 0;
    lines.push_back(line);
  }
  return lines;
}

struct Setup {
  fs::path dir;
  fs::path model;
  ChildProcess provider_server;  // the remote route's prefill host, on loopback
  std::map<std::string, std::unique_ptr<ServeUnderTest>> serves;
  std::string why;  // empty when ready
};

bool g_setup_started = false;

// kvshare-provider-server on a free loopback port, one forward-pass thread as the other
// providers have; its URL once it listens.
Result<std::string> start_provider_server(Setup& made) {
  auto port = route::pick_free_loopback_port();
  if (!port) return fail(port.error());
  const fs::path log = made.dir / "provider-server.log";
  SpawnOptions options;
  options.stderr_path = log.string();
  options.die_with_parent = true;
  options.env = {std::string("KVSHARE_REMOTE_KEY=") + kRemoteKey, "UCX_TLS=tcp"};
  auto child = ChildProcess::spawn({bin("kvshare-provider-server").string(), "-m", made.model.string(), "--host",
                                    "127.0.0.1", "--port", std::to_string(*port), "-t", "1"},
                                   options);
  if (!child) return fail(child.error());
  made.provider_server = std::move(*child);
  for (int i = 0; i < 2400; ++i) {
    if (read_all(log).find("listening on") != std::string::npos) return fmt::format("http://127.0.0.1:{}", *port);
    if (made.provider_server.poll_exit()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return fail(EIO, "kvshare-provider-server did not start listening (log {})", log.string());
}

Setup& setup() {
  g_setup_started = true;
  static Setup s = [] {
    Setup made;
    auto model = make_bench_model("kvshare-bench-route", {settings().backend, settings().provider}, made.why);
    if (!model) return made;
    made.dir = model->dir;
    made.model = model->model;
    auto remote_url = start_provider_server(made);
    if (!remote_url) {
      made.why = remote_url.error().what();
      return made;
    }
    for (const char* route_name : kRoutes) {
      auto serve = start_serve(route_name, made.model, made.dir, *remote_url, made.why);
      if (!serve) return made;
      made.serves[route_name] = std::move(serve);
    }
    return made;
  }();
  return s;
}

struct Request {
  double first_byte_ms = 0;
  double prefill_ms = 0;
  double handoff_ms = 0;
};

Result<Request> one_request(ServeUnderTest& serve, const std::string& route_name, const std::string& prompt) {
  const size_t lines_before = hybrid_lines(serve.stderr_path).size();
  route::UpstreamStream::Request request;
  request.host = "127.0.0.1";
  request.port = serve.port;
  request.method = "POST";
  request.path = "/v1/completions";
  request.body = nlohmann::json{{"prompt", prompt}, {"max_tokens", 1}, {"temperature", 0}, {"stream", true}}.dump();
  const auto start = Clock::now();
  auto stream = route::UpstreamStream::start(request, nullptr);
  std::string piece;
  const bool got = stream->wait_head().has_value() && stream->next(piece);
  Request out;
  out.first_byte_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  while (stream->next(piece)) {
  }
  stream.reset();
  if (!got) return fail(EPROTO, "no reply from kvshare-serve (route {}, log {})", route_name, serve.stderr_path.string());
  if (route_name == "cpu") return out;
  // Serve writes its line before the first byte goes out; the pipe to the file may lag.
  for (int i = 0; i < 200; ++i) {
    const auto lines = hybrid_lines(serve.stderr_path);
    if (lines.size() > lines_before) {
      const HybridLine& line = lines.back();
      if (line.route != route_name)
        return fail(EPROTO, "route {}: serve's line says the {} route was taken (log {})", route_name, line.route,
                    serve.stderr_path.string());
      out.prefill_ms = line.prefill_ms;
      out.handoff_ms = line.handoff_ms;
      return out;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return fail(EPROTO, "route {}: no new hybrid: line in {} (a fallback?)", route_name, serve.stderr_path.string());
}

void bm_rounds(benchmark::State& state) {
  Setup& s = setup();
  if (!s.why.empty()) return state.SkipWithError(s.why.c_str());
  const int n_tokens = static_cast<int>(state.range(0));
  const route::DecoderClient decoder("127.0.0.1", s.serves["file"]->decoder_port, std::chrono::seconds(120));
  static int salt = 0;
  std::map<std::string, std::vector<Request>> done;
  std::vector<double> overhead_saved;  // file - shared, per round
  std::vector<double> remote_added;    // remote - shared, per round
  size_t turn = 0;
  for (auto _ : state) {
    const std::string prompt = prompt_of(decoder, n_tokens, ++salt);
    std::map<std::string, Request> round;
    for (size_t k = 0; k < std::size(kRoutes); ++k) {
      const std::string route_name = kRoutes[(turn + k) % std::size(kRoutes)];
      auto request = one_request(*s.serves[route_name], route_name, prompt);
      if (!request) return state.SkipWithError(request.error().what().c_str());
      round[route_name] = *request;
    }
    ++turn;
    for (const auto& [name, request] : round) done[name].push_back(request);
    overhead_saved.push_back((round["file"].first_byte_ms - round["file"].prefill_ms) -
                             (round["shared"].first_byte_ms - round["shared"].prefill_ms));
    remote_added.push_back((round["remote"].first_byte_ms - round["remote"].prefill_ms) -
                           (round["shared"].first_byte_ms - round["shared"].prefill_ms));
    state.SetIterationTime(round["shared"].first_byte_ms / 1e3);
  }
  for (const auto& [name, requests] : done) {
    std::vector<double> first_byte, prefill, handoff, overhead;
    for (const Request& r : requests) {
      first_byte.push_back(r.first_byte_ms);
      prefill.push_back(r.prefill_ms);
      handoff.push_back(r.handoff_ms);
      overhead.push_back(r.first_byte_ms - r.prefill_ms);
    }
    record_spread(state, name + ".first_byte_ms", first_byte);
    record_spread(state, name + ".prefill_ms", prefill);
    record_spread(state, name + ".handoff_ms", handoff);
    record_spread(state, name + ".overhead_ms", overhead);
  }
  record_spread(state, "overhead_saved_ms", overhead_saved);
  record_spread(state, "remote_added_ms", remote_added);
  state.counters["rounds"] = static_cast<double>(state.iterations());
  state.counters["tokens"] = n_tokens;
}

void register_all(const BenchArgs& args) {
  Settings& s = settings();
  s.backend = bin("kvshare-decoder");
  s.provider = bin("kvshare-prefill");
  bool provider_given = false;
  for (size_t i = 0; i + 1 < args.rest.size(); ++i) {
    if (args.rest[i] == "--backend") s.backend = args.rest[++i];
    else if (args.rest[i] == "--provider") s.provider = args.rest[++i], provider_given = true;
    else if (args.rest[i] == "--rounds") s.rounds = std::max(1, std::atoi(args.rest[++i].c_str()));
  }
  s.is_llama_server = s.backend.filename() != "kvshare-decoder";
  if (s.is_llama_server && !provider_given) s.provider = s.backend.parent_path() / "llama-kvshare-prefill";
  std::vector<int> tokens = args.tokens;
  if (tokens.empty()) tokens = args.smoke ? std::vector<int>{16} : std::vector<int>{307, 4096};
  for (int n : tokens)
    benchmark::RegisterBenchmark(fmt::format("route/{}", n).c_str(), bm_rounds)
        ->Arg(n)
        ->Iterations(args.smoke ? 1 : s.rounds)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
}

int report(const std::vector<RunResult>& runs, const BenchArgs& args) {
  const Settings& s = settings();
  if (!args.json)
    fmt::print("\nroute (decoder {}, provider {}; generated model, -c 8192 -fa on f16; rounds of cpu, file, shared, "
               "remote with the order rotating)\n{:<7} {:>6} {:>26} {:>26} {:>22} {:>22} {:>7}\n",
               s.backend.filename().string(), s.provider.filename().string(), "route", "tokens",
               "first_byte_ms [p25..p75]", "overhead_ms [p25..p75]", "prefill_ms", "handoff_ms", "rounds");
  std::map<int, double> file_handoff, shared_overhead, saved, remote_added;
  for (const RunResult* run : runs_with_prefix(runs, "route/")) {
    auto c = [&](const std::string& key) { return run->counters.count(key) ? run->counters.at(key) : 0.0; };
    const int tokens = static_cast<int>(c("tokens"));
    if (tokens == 0) continue;  // skipped: nothing measured
    for (const char* name : kRoutes) {
      const std::string p = std::string(name) + ".";
      if (args.json) {
        fmt::print("{{\"bench\":\"route\",\"route\":\"{}\",\"tokens\":{},\"rounds\":{},\"decoder\":\"{}\"", name, tokens,
                   c("rounds"), s.backend.filename().string());
        for (const char* key : {"first_byte_ms", "overhead_ms", "prefill_ms", "handoff_ms"})
          fmt::print(",\"{0}\":{1:.3f},\"{0}_p25\":{2:.3f},\"{0}_p75\":{3:.3f}", key, c(p + key),
                     c(p + key + "_p25"), c(p + key + "_p75"));
        fmt::print("}}\n");
      } else {
        auto cell = [&](const std::string& key) {
          return fmt::format("{:.1f} [{:.1f}..{:.1f}]", c(p + key), c(p + key + "_p25"), c(p + key + "_p75"));
        };
        fmt::print("{:<7} {:>6} {:>26} {:>26} {:>22} {:>22} {:>7}\n", name, tokens, cell("first_byte_ms"),
                   name == std::string("cpu") ? std::string("-") : cell("overhead_ms"),
                   name == std::string("cpu") ? std::string("-") : cell("prefill_ms"),
                   name == std::string("cpu") ? std::string("-") : cell("handoff_ms"), c("rounds"));
      }
    }
    file_handoff[tokens] = c("file.handoff_ms");
    shared_overhead[tokens] = c("shared.overhead_ms");
    saved[tokens] = c("overhead_saved_ms");
    remote_added[tokens] = c("remote_added_ms");
    if (args.json)
      fmt::print("{{\"bench\":\"route_paired\",\"tokens\":{},\"overhead_saved_ms\":{:.3f},\"overhead_saved_ms_p25\":{:.3f},"
                 "\"overhead_saved_ms_p75\":{:.3f},\"file_handoff_ms\":{:.3f}}}\n",
                 tokens, saved[tokens], c("overhead_saved_ms_p25"), c("overhead_saved_ms_p75"), file_handoff[tokens]);
    if (args.json)
      fmt::print("{{\"bench\":\"route_remote_paired\",\"tokens\":{},\"remote_added_ms\":{:.3f},"
                 "\"remote_added_ms_p25\":{:.3f},\"remote_added_ms_p75\":{:.3f}}}\n",
                 tokens, remote_added[tokens], c("remote_added_ms_p25"), c("remote_added_ms_p75"));
  }
  if (!args.json)
    for (const auto& [tokens, value] : saved)
      fmt::print("{} tokens: file - shared overhead_ms per round, median {:.1f} ms; target >= half the file handoff "
                 "({:.1f} ms): {}\n",
                 tokens, value, file_handoff[tokens] / 2, value >= file_handoff[tokens] / 2 ? "met" : "missed");
  if (!args.json)
    for (const auto& [tokens, value] : remote_added)
      fmt::print("{} tokens: remote - shared overhead_ms per round, median {:.1f} ms (what the receiver process, the "
                 "provider server's HTTP hop and UCX tcp add to the shared route)\n",
                 tokens, value);
  if (!args.json && shared_overhead.size() >= 2 && shared_overhead.begin()->second > 0)
    fmt::print("shared overhead_ms {} / {} tokens: {:.2f}x (target <= 1.5)\n", shared_overhead.rbegin()->first,
               shared_overhead.begin()->first, shared_overhead.rbegin()->second / shared_overhead.begin()->second);
  if (g_setup_started) {
    Setup& made = setup();
    made.serves.clear();
    made.provider_server.terminate(std::chrono::seconds(10));
    std::error_code ec;
    if (!made.dir.empty()) fs::remove_all(made.dir, ec);
  }
  return 0;
}

const bool registered = add_group({
    "route",
    "kvshare-serve end to end, paired rounds of --device cpu / file / shared / remote on the same prompts: first byte and "
    "overhead_ms (first byte - the provider's prefill_ms); --backend PATH for another decoder (llama-server)",
    register_all,
    report,
    {
        {"--backend", "PATH", "the decoder (default kvshare-decoder; a patched llama-server)"},
        {"--provider", "PATH", "the provider (default kvshare-prefill, or llama-kvshare-prefill beside --backend)"},
        {"--rounds", "N", "paired rounds per length (default 9)"},
    },
});

}  // namespace
}  // namespace kvshare::bench
