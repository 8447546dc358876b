// kvshare-bench route: what each route adds to the time to first byte through
// kvshare-serve, for prompts of 307 and 4096 tokens (--tokens N[,N...], up to 32768 and
// more: the model's context and serve's -c follow the longest) on a generated model. Six
// serves run side by side, each with its own decoder: --device cpu, the file route, the
// shared route, the remote route (prefilled by a kvshare-provider-server on loopback, its
// rows over UCX tcp into serve's kvshare-remote-receiver), and the file and shared routes
// again with a resident provider (file_resident, shared_resident: the same flags plus
// --provider-resident, issue 24: the provider started once, the model loaded and the
// region mapped once). Every round sends the same fresh prompt to each, the order rotating
// from round to round, so a slow moment of the machine falls on every route alike.
//
// Per request: first_byte_ms (measured here), and from serve's `hybrid:` line the
// provider's own prefill_ms and serve's handoff_ms (restore, or share + adopt).
// overhead_ms = first_byte_ms - prefill_ms is what the route adds to the provider's work:
// starting the provider and loading the model, the handoff, the decoder's one-token step,
// the HTTP hops. The spread of a CPU prefill drowns a handoff's milliseconds in first_byte_ms;
// overhead_ms takes the prefill out, request by request. Serve's `phases:` line splits
// each request further (tokenize, share, the provider's wall time and the region's part of
// it, adopt or restore, the decoder's first token); the report prints their medians, and
// provider - prefill: a per-request provider's start, model load and exit, a resident
// one's round trip on its channel.
//
// A resident provider's point is the first byte on a real model: --model 100m generates a
// ~100M-parameter qwen3-shaped model (prefill_bench.cc's shape) instead of the tiny one,
// and the report sets the first byte each resident route saves, round by round, beside the
// model load it should save at least (the reference model's map and parse, timed here).
//
// The decoder is kvshare-decoder (with kvshare-prefill as the provider) unless
// --backend PATH names another, such as a llama-server built with the patch series of
// integrations/llama.cpp; its provider is then llama-kvshare-prefill beside it (or
// --provider PATH), so that both run the same llama.cpp.
//
// --arch A[,A...] (issue 26: the handoff figures per memory kind) runs the whole group once
// per kvshare-mkmodel arch, one after the other, on the same prompts: qwen3 (the default),
// qwen2 and llama hold one plain KV cache, mamba2 a recurrent state, lfm2 and qwen35 a
// hybrid memory, gemma3 a base and an SWA cache. Only the patched llama-server holds the
// other kinds; the remote route runs for plain KV only (kvshare-provider-server's reference
// model computes one plain KV cache), and the output says which routes were not run, and why.
// Group flags (after --, or before it for these two): --backend PATH, --provider PATH;
// --arch A[,A...]; --rounds N (default 9, 5 with more than one arch); --routes R[,R...]
// (default all six); --model tiny|100m. A provider without --serve-fd (its --help does not
// name it) runs per request only, and the report says the resident routes were not run.
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench_files.h"
#include "bench_registry.h"
#include "bench_serve.h"
#include "bench_stats.h"
#include "kvshare/mapping.h"
#include "kvshare/share/spawn.h"
#include "refmodel/engine.h"
#include "route/decoder_client.h"
#include "route/decoder_process.h"
#include "route/upstream_stream.h"

namespace kvshare::bench {
namespace {

namespace fs = std::filesystem;
using kvshare::ChildProcess;
using Clock = std::chrono::steady_clock;

const char* const kRoutes[] = {"cpu", "file", "shared", "remote", "file_resident", "shared_resident"};
// The remote route's provider server and its deployment key (the same for the run).
constexpr const char* kRemoteKey = "kvshare-bench-route-key";

// gemma3's SWA cache, as llama.cpp sizes it for the decoder serve starts here (no -ub: its
// default 512): pad256(n_swa + n_ubatch) cells (docs/layout.md), n_swa being
// kvshare-mkmodel's default --swa-window.
constexpr int kGemma3Window = 32;
constexpr int kDecoderUbatch = 512;
constexpr int kGemma3SwaCells = (kGemma3Window + kDecoderUbatch + 255) / 256 * 256;  // 768

// --model 100m: prefill_bench.cc's ~100M-parameter shape, as kvshare-mkmodel flags.
const std::vector<std::string> k100mModel = {"--layers",   "16", "--heads", "12",   "--heads-kv", "4",  "--embd", "768",
                                             "--head-dim", "64", "--ff",    "2048", "--wtype",    "f16"};

struct Settings {
  fs::path backend;   // the decoder binary
  fs::path provider;  // the prefill provider
  bool is_llama_server = false;
  int rounds = 9;
  std::vector<std::string> archs;   // kvshare-mkmodel --arch, in run order
  std::vector<std::string> routes;  // --routes, in kRoutes order
  std::string model = "tiny";       // --model
  int n_ctx = 8192;                 // the model's context_length and serve's -c
  std::string resident_why;         // why the resident routes cannot run ("" when they can)
};

Settings& settings() {
  static Settings s;
  return s;
}

// The memory llama.cpp builds for each kvshare-mkmodel arch (docs/refmodel.md), by
// llama.cpp's names for it.
std::string memory_of(const std::string& arch) {
  if (arch == "mamba2") return "recurrent";
  if (arch == "lfm2" || arch == "qwen35") return "hybrid";
  if (arch == "gemma3") return "kv_iswa";
  return "kv";  // qwen3, qwen2, llama
}

// Why nothing is measured for `arch`, at any length; "" when it is.
std::string kind_not_run(const std::string& arch) {
  if (memory_of(arch) != "kv" && !settings().is_llama_server)
    return fmt::format(
        "kvshare-decoder and kvshare-prefill hold one plain KV cache; a {} memory needs --backend, a "
        "llama-server built with the patch series",
        memory_of(arch));
  return "";
}

// Why nothing is measured for `arch` at `n_tokens` when the kind is; "" when it is.
std::string length_not_run(const std::string& arch, int n_tokens) {
  // llama-server reuses an iSWA handoff only when the prompt has n_swa + 2 tokens or more
  // (docs/hybrid.md, "Memory kinds"); a shorter one it re-processes, and the figure would be
  // the decoder's prefill, not the handoff's.
  if (arch == "gemma3" && n_tokens < kGemma3Window + 2)
    return fmt::format("below {} tokens (the window + 2) the decoder re-processes an iSWA handoff", kGemma3Window + 2);
  return "";
}

bool is_resident(const std::string& route) { return route.ends_with("_resident"); }

// The route serve's `hybrid:` line names for a request of `route`: "shared_resident" is a
// shared handoff.
std::string handoff_of(const std::string& route) {
  return is_resident(route) ? route.substr(0, route.size() - std::string("_resident").size()) : route;
}

// Why `route` is not measured for `arch` at `n_tokens` when the arch is; "" when it is.
std::string route_not_run(const std::string& arch, int n_tokens, const std::string& route) {
  if (is_resident(route) && !settings().resident_why.empty()) return settings().resident_why;
  if (route == "remote" && memory_of(arch) != "kv")
    return "the remote route covers one plain KV cache (kvshare-provider-server runs the reference model)";
  // gemma3's shared route is measured only where the prompt fits the SWA cache. Past it the
  // provider's ring would have wrapped, adopt refuses and serve forwards the request: a
  // figure of that fallback, not of a handoff. A larger -ub cannot make 4096 tokens fit
  // (n_ubatch is at most -b, 2048 by default) and would run gemma3 with other batches than
  // the other archs; --swa-full must not be used on the file route (docs/hybrid.md). So
  // the file route keeps the long prompt (its restore keeps n_swa + 1 SWA positions,
  // whatever the length) and the shared route is reported as not run there. A released
  // gemma3 (window 1024: 1536 cells at -ub 512) meets the same limit at longer prompts.
  if (arch == "gemma3" && handoff_of(route) == "shared" && n_tokens - 1 > kGemma3SwaCells)
    return fmt::format(
        "the handoff of {} cells does not fit gemma3's SWA cache of {} cells (pad256(n_swa {} + "
        "n_ubatch {})): adopt would refuse and serve forward the request",
        n_tokens - 1, kGemma3SwaCells, kGemma3Window, kDecoderUbatch);
  return "";
}

// The routes measured for `arch` at `n_tokens`, of those asked for, in kRoutes order.
std::vector<std::string> routes_of(const std::string& arch, int n_tokens) {
  std::vector<std::string> routes;
  for (const std::string& route_name : settings().routes)
    if (route_not_run(arch, n_tokens, route_name).empty()) routes.push_back(route_name);
  return routes;
}

// One kvshare-serve per route, started once per arch and stopped before the next arch.
std::unique_ptr<ServeUnderTest> start_serve(const std::string& route, const fs::path& model, const fs::path& dir,
                                            const std::string& remote_url, std::string& why) {
  ServeLaunch launch;
  launch.name = route;
  launch.args = {"-m",        model.string(),
                 "--device",  route == "cpu" ? "cpu" : "hybrid",
                 "--backend", settings().backend.string(),
                 "-c",        std::to_string(settings().n_ctx),
                 "-fa",       "on",
                 "-ctk",      "f16",
                 "-ctv",      "f16"};
  if (route == "remote")
    launch.args.insert(launch.args.end(), {"--prefill-remote", remote_url});
  else if (route != "cpu")
    launch.args.insert(launch.args.end(), {"--prefill-provider", settings().provider.string()});
  if (is_resident(route)) launch.args.push_back("--provider-resident");
  // The bench measures the handoff itself: every prompt takes it.
  if (route != "cpu") launch.args.insert(launch.args.end(), {"--handoff", "always"});
  // A CPU prefill of a long prompt (32768 tokens) takes minutes on a busy machine: a
  // provider killed at serve's default 120 s would measure a fallback.
  if (route != "cpu") launch.args.insert(launch.args.end(), {"--provider-timeout", "1800"});
  launch.kv_share = handoff_of(route) == "shared";
  launch.env = {std::string("KVSHARE_REMOTE_KEY=") + kRemoteKey, "UCX_TLS=tcp"};
  return kvshare::bench::start_serve(launch, dir, why);
}

// Serve's `hybrid:` lines: the provider's prefill and serve's handoff, per request.
struct HybridLine {
  double prefill_ms = 0;
  double handoff_ms = 0;
  std::string route;  // "file", "shared" or "remote"
};

std::vector<HybridLine> hybrid_lines(const std::string& log) {
  const std::regex line_re(
      R"(hybrid: \d+ prompt tokens(?:, \d+ cached)?: prefill ([\d.]+) ms(?: of \d+ tokens)?, (share ([\d.]+) ms( remote)?, )?(restore ([\d.]+) ms, )?first byte)");
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

// Serve's `phases:` line, logged after each `hybrid:` line of a handoff.
struct Phases {
  double tokenize_ms = 0, share_ms = 0, provider_ms = 0, region_ms = 0, adopt_ms = 0, first_token_ms = 0;
};
// The phase names as the report and the JSON give them: adopt_ms is the restore on the file route.
const char* const kPhaseKeys[] = {"tokenize_ms", "share_ms", "provider_ms", "region_ms", "adopt_ms", "first_token_ms"};

std::vector<Phases> phases_lines(const std::string& log) {
  const std::regex line_re(
      R"(phases: tokenize ([\d.]+) ms, share ([\d.]+) ms, provider ([\d.]+) ms \(region ([\d.]+) ms\), (?:adopt|restore) ([\d.]+) ms, first token (-?[\d.]+) ms)");
  std::vector<Phases> lines;
  for (std::sregex_iterator it(log.begin(), log.end(), line_re), end; it != end; ++it)
    lines.push_back({std::stod((*it)[1]), std::stod((*it)[2]), std::stod((*it)[3]), std::stod((*it)[4]),
                     std::stod((*it)[5]), std::stod((*it)[6])});
  return lines;
}

double phase(const Phases& p, const std::string& key) {
  if (key == "tokenize_ms") return p.tokenize_ms;
  if (key == "share_ms") return p.share_ms;
  if (key == "provider_ms") return p.provider_ms;
  if (key == "region_ms") return p.region_ms;
  if (key == "adopt_ms") return p.adopt_ms;
  return p.first_token_ms;
}

// What a resident provider saves at least: the reference model's load as kvshare-prefill
// does it (map the GGUF, parse it, build the model), timed in this process with the file in
// the page cache, median of 3. 0 when it does not load (another provider's format).
double model_load_ms(const fs::path& model) {
  std::vector<double> took;
  for (int i = 0; i < 3; ++i) {
    const auto start = Clock::now();
    auto mapping = Mapping::map_file_readonly(model.string());
    if (!mapping) return 0;
    auto keep = std::make_shared<Mapping>(std::move(*mapping));
    auto loaded = refmodel::Model::from_gguf(keep->bytes(), keep, model.string());
    if (!loaded) return 0;
    took.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  }
  return median(took);
}

// The serves of one arch, with their model and (plain KV only) the remote route's provider.
struct Setup {
  std::string arch;
  fs::path dir;
  fs::path model;
  ChildProcess provider_server;  // the remote route's prefill host, on loopback
  std::map<std::string, std::unique_ptr<ServeUnderTest>> serves;
  std::string why;  // empty when ready
  int salt = 0;     // the prompts' salts: the same sequence for every arch
  double model_load_ms = 0;
  bool warmed = false;  // every serve took its warm-up request
};

std::unique_ptr<Setup> g_setup;  // the arch being measured; one at a time

void stop_setup() {
  if (!g_setup) return;
  g_setup->serves.clear();
  g_setup->provider_server.terminate(std::chrono::seconds(10));
  std::error_code ec;
  if (!g_setup->dir.empty()) fs::remove_all(g_setup->dir, ec);
  g_setup.reset();
}

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

// The serves of `arch`, started on its first benchmark; those of the arch before are
// stopped first, so two archs' decoders never share the two cores.
Setup& setup(const std::string& arch) {
  if (g_setup && g_setup->arch == arch) return *g_setup;
  stop_setup();
  g_setup = std::make_unique<Setup>();
  Setup& made = *g_setup;
  made.arch = arch;
  std::vector<std::string> mkmodel_args = {"--arch", arch};
  if (settings().model == "100m") mkmodel_args.insert(mkmodel_args.end(), k100mModel.begin(), k100mModel.end());
  auto model = make_bench_model("kvshare-bench-route", {settings().backend, settings().provider}, made.why,
                                mkmodel_args, settings().n_ctx);
  if (!model) return made;
  made.dir = model->dir;
  made.model = model->model;
  made.model_load_ms = model_load_ms(made.model);
  const auto& asked = settings().routes;
  std::string remote_url;
  if (memory_of(arch) == "kv" && std::find(asked.begin(), asked.end(), "remote") != asked.end()) {
    auto url = start_provider_server(made);
    if (!url) {
      made.why = url.error().what();
      return made;
    }
    remote_url = *url;
  }
  for (const std::string& route_name : asked) {
    if (route_name == "remote" && remote_url.empty()) continue;
    if (is_resident(route_name) && !settings().resident_why.empty()) continue;
    auto serve = start_serve(route_name, made.model, made.dir, remote_url, made.why);
    if (!serve) return made;
    made.serves[route_name] = std::move(serve);
  }
  return made;
}

struct Request {
  double first_byte_ms = 0;
  double prefill_ms = 0;
  double handoff_ms = 0;
  std::optional<Phases> phases;  // serve's phases: line, when it came
  std::string taken;             // the route serve's line names ("forwarded" when it forwarded); "cpu" for cpu
  std::string fallback;          // serve's line saying why it did not take the route asked for
};

Result<Request> one_request(ServeUnderTest& serve, const std::string& route_name, const std::string& prompt) {
  const size_t log_before = read_all(serve.stderr_path).size();
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
  if (!got)
    return fail(EPROTO, "no reply from kvshare-serve (route {}, log {})", route_name, serve.stderr_path.string());
  out.taken = route_name;
  if (route_name == "cpu") return out;
  const std::regex forwarded_re(R"(hybrid: \d+ prompt tokens(?:, \d+ cached)?: forwarded)");
  const std::regex fallback_re(R"(hybrid: (?:shared route not taken|fallback) \([a-z_]+\)[^\n]*)");
  // Serve writes its lines before the first byte goes out; the pipe to the file may lag.
  // The phases: line follows the hybrid: line; a serve that wrote the one and not the other
  // within the wait gives a request without phases.
  for (int i = 0; i < 200; ++i) {
    const std::string log = read_all(serve.stderr_path);
    const std::string fresh = log.size() > log_before ? log.substr(log_before) : std::string();
    std::smatch match;
    if (std::regex_search(fresh, match, fallback_re)) out.fallback = match[0];
    const auto lines = hybrid_lines(fresh);
    const auto phases = phases_lines(fresh);
    if (!lines.empty() && (!phases.empty() || i == 199)) {
      const HybridLine& line = lines.back();
      out.taken = line.route;
      out.prefill_ms = line.prefill_ms;
      out.handoff_ms = line.handoff_ms;
      if (!phases.empty()) out.phases = phases.back();
      return out;
    }
    if (std::regex_search(fresh, forwarded_re)) {
      out.taken = "forwarded";
      return out;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return fail(EPROTO, "route {}: no new hybrid: line in {}", route_name, serve.stderr_path.string());
}

// The first fallback line per "arch/tokens/route" (a counter holds only numbers).
std::map<std::string, std::string>& fallback_lines() {
  static std::map<std::string, std::string> lines;
  return lines;
}

// One request per serve before the first round, untimed: a resident provider is sent the
// decoder's region on its first shared request (once per share generation, not per request),
// and every decoder allocates some of its buffers on its first request; neither belongs in
// a round. 64 tokens: above gemma3's window + 2, within its SWA cache.
Result<void> warm_up(Setup& s) {
  if (s.warmed) return {};
  const route::DecoderClient decoder("127.0.0.1", s.serves.begin()->second->decoder_port, std::chrono::seconds(120));
  const std::string prompt = prompt_of(decoder, 64, 0);
  for (auto& [name, serve] : s.serves)
    if (auto warm = one_request(*serve, name, prompt); !warm) return fail(warm.error().with_context("warm-up request"));
  s.warmed = true;
  return {};
}

void bm_rounds(benchmark::State& state, const std::string& arch) {
  const int n_tokens = static_cast<int>(state.range(0));
  for (const std::string& why : {kind_not_run(arch), length_not_run(arch, n_tokens)})
    if (!why.empty()) return state.SkipWithError(why.c_str());
  Setup& s = setup(arch);
  if (!s.why.empty()) return state.SkipWithError(s.why.c_str());
  if (auto warm = warm_up(s); !warm) return state.SkipWithError(warm.error().what().c_str());
  const std::vector<std::string> routes = routes_of(arch, n_tokens);
  if (routes.empty()) return state.SkipWithError("no route of --routes runs here (see the lines on what was not run)");
  // Any serve's decoder tokenizes the prompts: they all load the same model.
  const route::DecoderClient decoder("127.0.0.1", s.serves[routes.front()]->decoder_port, std::chrono::seconds(120));
  std::map<std::string, size_t> log_start;  // where this length's requests begin in each serve's log
  for (const auto& [name, serve] : s.serves) log_start[name] = read_all(serve->stderr_path).size();
  std::map<std::string, std::vector<Request>> done;
  std::vector<double> overhead_saved;                         // file - shared, per round
  std::vector<double> remote_added;                           // remote - shared, per round
  std::map<std::string, std::vector<double>> resident_saved;  // first byte, per-request - resident, per round
  size_t turn = 0;
  for (auto _ : state) {
    const std::string prompt = prompt_of(decoder, n_tokens, ++s.salt);
    std::map<std::string, Request> round;
    for (size_t k = 0; k < routes.size(); ++k) {
      const std::string& route_name = routes[(turn + k) % routes.size()];
      auto request = one_request(*s.serves[route_name], route_name, prompt);
      if (!request) return state.SkipWithError(request.error().what().c_str());
      round[route_name] = *request;
    }
    ++turn;
    for (const auto& [name, request] : round) done[name].push_back(request);
    // A pair counts only when both requests took the route asked for.
    auto overhead = [&](const std::string& name) { return round[name].first_byte_ms - round[name].prefill_ms; };
    auto took = [&](const std::string& name) { return round.count(name) && round[name].taken == handoff_of(name); };
    if (took("file") && took("shared")) overhead_saved.push_back(overhead("file") - overhead("shared"));
    if (took("remote") && took("shared")) remote_added.push_back(overhead("remote") - overhead("shared"));
    for (const char* name : {"file", "shared"})
      if (took(name) && took(std::string(name) + "_resident"))
        resident_saved[name].push_back(round[name].first_byte_ms -
                                       round[std::string(name) + "_resident"].first_byte_ms);
    state.SetIterationTime(round[round.count("shared") ? "shared" : routes.front()].first_byte_ms / 1e3);
  }
  for (const auto& [name, requests] : done) {
    std::vector<double> first_byte, prefill, handoff, overhead, outside;
    std::map<std::string, std::vector<double>> phase_values;
    double fallbacks = 0;
    for (const Request& r : requests) {
      if (r.taken != handoff_of(name)) {
        ++fallbacks;
        auto& line = fallback_lines()[fmt::format("{}/{}/{}", arch, n_tokens, name)];
        if (line.empty()) line = r.fallback.empty() ? "serve took the " + r.taken + " route" : r.fallback;
        continue;
      }
      first_byte.push_back(r.first_byte_ms);
      prefill.push_back(r.prefill_ms);
      handoff.push_back(r.handoff_ms);
      overhead.push_back(r.first_byte_ms - r.prefill_ms);
      if (r.phases) {
        for (const char* key : kPhaseKeys) phase_values[key].push_back(phase(*r.phases, key));
        // The remote route's provider is the server's, not timed at serve: no provider phase.
        if (r.phases->provider_ms > 0) outside.push_back(r.phases->provider_ms - r.prefill_ms);
      }
    }
    for (const auto& [key, values] : phase_values) record_spread(state, name + ".phase." + key, values);
    if (!outside.empty()) record_spread(state, name + ".provider_outside_ms", outside);
    record_spread(state, name + ".first_byte_ms", first_byte);
    record_spread(state, name + ".prefill_ms", prefill);
    record_spread(state, name + ".handoff_ms", handoff);
    record_spread(state, name + ".overhead_ms", overhead);
    state.counters[name + ".fallbacks"] = fallbacks;
    state.counters[name + ".measured"] = static_cast<double>(first_byte.size());
    // Serve warns when the decoder evaluated more than the last token: the handoff was
    // not reused (gemma3 below its window + 2, or a memory the decoder could not resume).
    const std::string log = read_all(s.serves[name]->stderr_path);
    double not_reused = 0;
    for (size_t at = log.find("the handoff was not reused", log_start[name]); at != std::string::npos;
         at = log.find("the handoff was not reused", at + 1))
      ++not_reused;
    state.counters[name + ".not_reused"] = not_reused;
  }
  if (!overhead_saved.empty()) record_spread(state, "overhead_saved_ms", overhead_saved);
  if (!remote_added.empty()) record_spread(state, "remote_added_ms", remote_added);
  for (const auto& [name, saved] : resident_saved) record_spread(state, name + "_resident.first_byte_saved_ms", saved);
  state.counters["model_load_ms"] = s.model_load_ms;
  state.counters["rounds"] = static_cast<double>(state.iterations());
  state.counters["tokens"] = n_tokens;
}

void register_all(const BenchArgs& args) {
  Settings& s = settings();
  s.backend = bin("kvshare-decoder");
  s.provider = bin("kvshare-prefill");
  bool provider_given = false;
  bool rounds_given = false;
  s.archs.clear();
  std::vector<std::string> routes_asked;
  for (size_t i = 0; i + 1 < args.rest.size(); ++i) {
    if (args.rest[i] == "--backend")
      s.backend = args.rest[++i];
    else if (args.rest[i] == "--provider")
      s.provider = args.rest[++i], provider_given = true;
    else if (args.rest[i] == "--rounds")
      s.rounds = std::max(1, std::atoi(args.rest[++i].c_str())), rounds_given = true;
    else if (args.rest[i] == "--model")
      s.model = args.rest[++i];
    else if (args.rest[i] == "--arch" || args.rest[i] == "--routes") {
      std::vector<std::string>& into = args.rest[i] == "--arch" ? s.archs : routes_asked;
      std::stringstream list(args.rest[++i]);
      for (std::string item; std::getline(list, item, ',');)
        if (!item.empty() && std::find(into.begin(), into.end(), item) == into.end()) into.push_back(item);
    }
  }
  if (s.archs.empty()) s.archs = {"qwen3"};
  s.routes.clear();
  for (const char* route_name : kRoutes)
    if (routes_asked.empty() || std::find(routes_asked.begin(), routes_asked.end(), route_name) != routes_asked.end())
      s.routes.push_back(route_name);
  // Every arch is a whole run of the group: fewer rounds keep a comparison of kinds quick.
  if (!rounds_given && s.archs.size() > 1) s.rounds = 5;
  s.is_llama_server = s.backend.filename() != "kvshare-decoder";
  if (s.is_llama_server && !provider_given) s.provider = s.backend.parent_path() / "llama-kvshare-prefill";
  s.resident_why = resident_support(s.provider);
  const std::vector<int>& tokens = args.tokens;
  // The longest prompt and the one generated token fit the context (llama.cpp pads it to 256).
  s.n_ctx = 8192;
  for (int n : tokens) s.n_ctx = std::max(s.n_ctx, (n + 1 + 255) / 256 * 256);
  for (const std::string& arch : s.archs)
    for (int n : tokens)
      benchmark::RegisterBenchmark(fmt::format("route/{}/{}", arch, n).c_str(), bm_rounds, arch)
          ->Arg(n)
          ->Iterations(args.smoke ? 1 : s.rounds)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
}

// "route/ARCH/N..." -> ARCH.
std::string arch_of_run(const std::string& name) {
  const size_t from = name.find('/') + 1;
  return name.substr(from, name.find('/', from) - from);
}

std::string model_words() {
  return settings().model == "100m" ? "~100M-parameter generated model (16 layers, embd 768, f16)" : "generated model";
}

int report(const std::vector<RunResult>& runs, const BenchArgs& args) {
  const Settings& s = settings();
  if (!args.json)
    fmt::print(
        "\nroute (decoder {}, provider {}; {} per arch, -c {} -fa on f16; rounds of {} with the order "
        "rotating)\n{:<7} {:<9} {:<15} {:>6} {:>26} {:>26} {:>22} {:>22} {:>7}\n",
        s.backend.filename().string(), s.provider.filename().string(), model_words(), s.n_ctx,
        fmt::join(s.routes, ", "), "arch", "memory", "route", "tokens", "first_byte_ms [p25..p75]",
        "overhead_ms [p25..p75]", "prefill_ms", "handoff_ms", "rounds");
  struct Paired {
    std::string arch;
    int tokens = 0;
    double file_handoff = 0, shared_overhead = 0, saved = 0, remote_added = 0;
    bool has_saved = false, has_remote = false;
    std::map<std::string, double> overhead;        // route -> median overhead_ms, routes measured here
    std::map<std::string, Spread> resident_saved;  // "shared", "file" -> first byte saved per round
    std::map<std::string, double> outside;         // per-request route -> median provider - prefill
    double model_load = 0;
  };
  std::vector<Paired> paired;
  std::vector<std::string> notes;
  std::vector<std::string> phase_rows;
  for (const RunResult* run : runs_with_prefix(runs, "route/")) {
    auto c = [&](const std::string& key) { return run->counters.count(key) ? run->counters.at(key) : 0.0; };
    auto has = [&](const std::string& key) { return run->counters.count(key) > 0; };
    const int tokens = static_cast<int>(c("tokens"));
    if (tokens == 0) continue;  // skipped: nothing measured
    const std::string arch = arch_of_run(run->name);
    Paired pair{arch,
                tokens,
                c("file.handoff_ms"),
                c("shared.overhead_ms"),
                c("overhead_saved_ms"),
                c("remote_added_ms"),
                has("overhead_saved_ms"),
                has("remote_added_ms")};
    pair.model_load = c("model_load_ms");
    for (const std::string& name : routes_of(arch, tokens)) {
      const std::string p = name + ".";
      if (name != "cpu" && c(p + "measured") > 0) pair.overhead[name] = c(p + "overhead_ms");
      if (has(p + "provider_outside_ms")) pair.outside[name] = c(p + "provider_outside_ms");
      if (has(p + "first_byte_saved_ms"))
        pair.resident_saved[handoff_of(name)] = {c(p + "first_byte_saved_ms_p25"), c(p + "first_byte_saved_ms"),
                                                 c(p + "first_byte_saved_ms_p75")};
      const std::string fell_back = c(p + "fallbacks") > 0
                                        ? fmt::format("{} of {} fell back: {}", c(p + "fallbacks"), c("rounds"),
                                                      fallback_lines()[fmt::format("{}/{}/{}", arch, tokens, name)])
                                        : "";
      if (args.json) {
        fmt::print(
            "{{\"bench\":\"route\",\"arch\":\"{}\",\"memory\":\"{}\",\"route\":\"{}\",\"tokens\":{},\"rounds\":{},"
            "\"decoder\":\"{}\",\"model\":\"{}\",\"resident\":{}",
            arch, memory_of(arch), name, tokens, c("rounds"), s.backend.filename().string(), s.model,
            is_resident(name));
        for (const char* key : {"first_byte_ms", "overhead_ms", "prefill_ms", "handoff_ms"})
          fmt::print(",\"{0}\":{1:.3f},\"{0}_p25\":{2:.3f},\"{0}_p75\":{3:.3f}", key, c(p + key), c(p + key + "_p25"),
                     c(p + key + "_p75"));
        for (const char* key : kPhaseKeys)
          if (has(p + "phase." + key))
            fmt::print(",\"{0}\":{1:.3f},\"{0}_p25\":{2:.3f},\"{0}_p75\":{3:.3f}", std::string("phase_") + key,
                       c(p + "phase." + key), c(p + "phase." + key + "_p25"), c(p + "phase." + key + "_p75"));
        if (has(p + "provider_outside_ms"))
          fmt::print(
              ",\"provider_outside_ms\":{:.3f},\"provider_outside_ms_p25\":{:.3f},\"provider_outside_ms_p75\":{:.3f}",
              c(p + "provider_outside_ms"), c(p + "provider_outside_ms_p25"), c(p + "provider_outside_ms_p75"));
        fmt::print(",\"fallbacks\":{},\"not_reused\":{}", c(p + "fallbacks"), c(p + "not_reused"));
        if (!fell_back.empty()) fmt::print(",\"fallback\":{}", nlohmann::json(fell_back).dump());
        fmt::print("}}\n");
      } else {
        const bool is_cpu = name == "cpu";
        auto cell = [&](const std::string& key) {
          if (is_cpu || c(p + "measured") == 0) return std::string("-");
          return fmt::format("{:.1f} [{:.1f}..{:.1f}]", c(p + key), c(p + key + "_p25"), c(p + key + "_p75"));
        };
        fmt::print("{:<7} {:<9} {:<15} {:>6} {:>26} {:>26} {:>22} {:>22} {:>7}{}\n", arch, memory_of(arch), name,
                   tokens,
                   c(p + "measured") == 0 ? std::string("-")
                                          : fmt::format("{:.1f} [{:.1f}..{:.1f}]", c(p + "first_byte_ms"),
                                                        c(p + "first_byte_ms_p25"), c(p + "first_byte_ms_p75")),
                   cell("overhead_ms"), cell("prefill_ms"), cell("handoff_ms"), c("rounds"),
                   fell_back.empty() ? "" : "  (" + fell_back + ")");
        if (has(p + "phase.provider_ms"))
          phase_rows.push_back(fmt::format(
              "{:<7} {:<15} {:>6} {:>9.2f} {:>9.2f} {:>10.2f} {:>8.2f} {:>10.2f} {:>16} {:>9.2f} {:>11.2f} {:>11.2f}",
              arch, name, tokens, c(p + "phase.tokenize_ms"), c(p + "phase.share_ms"), c(p + "phase.provider_ms"),
              c(p + "phase.region_ms"), c(p + "prefill_ms"),
              has(p + "provider_outside_ms") ? fmt::format("{:.2f}", c(p + "provider_outside_ms")) : "-",
              c(p + "phase.adopt_ms"), c(p + "phase.first_token_ms"), c(p + "overhead_ms")));
      }
      if (c(p + "not_reused") > 0)
        notes.push_back(
            fmt::format("{} {} at {} tokens: serve warned {} time(s) that the decoder evaluated more than "
                        "the last token (the handoff was not reused)",
                        arch, name, tokens, c(p + "not_reused")));
    }
    paired.push_back(pair);
    if (args.json && pair.has_saved)
      fmt::print(
          "{{\"bench\":\"route_paired\",\"arch\":\"{}\",\"tokens\":{},\"overhead_saved_ms\":{:.3f},"
          "\"overhead_saved_ms_p25\":{:.3f},\"overhead_saved_ms_p75\":{:.3f},\"file_handoff_ms\":{:.3f}}}\n",
          arch, tokens, pair.saved, c("overhead_saved_ms_p25"), c("overhead_saved_ms_p75"), pair.file_handoff);
    if (args.json && pair.has_remote)
      fmt::print(
          "{{\"bench\":\"route_remote_paired\",\"arch\":\"{}\",\"tokens\":{},\"remote_added_ms\":{:.3f},"
          "\"remote_added_ms_p25\":{:.3f},\"remote_added_ms_p75\":{:.3f}}}\n",
          arch, tokens, pair.remote_added, c("remote_added_ms_p25"), c("remote_added_ms_p75"));
    if (args.json)
      for (const auto& [handoff, saved] : pair.resident_saved)
        fmt::print(
            "{{\"bench\":\"route_resident_paired\",\"arch\":\"{}\",\"tokens\":{},\"model\":\"{}\",\"route\":\"{}\","
            "\"first_byte_saved_ms\":{:.3f},\"first_byte_saved_ms_p25\":{:.3f},\"first_byte_saved_ms_p75\":{:.3f},"
            "\"per_request_outside_ms\":{:.3f},\"model_load_ms\":{:.3f}}}\n",
            arch, tokens, s.model, handoff, saved.median, saved.p25, saved.p75,
            pair.outside.count(handoff) ? pair.outside.at(handoff) : 0.0, pair.model_load);
  }
  // What was not run, and why: one line per reason, naming the archs (and lengths) it hit.
  const std::vector<int>& tokens = args.tokens;
  std::vector<std::pair<std::string, std::vector<std::string>>> not_run;  // why, what
  auto add_not_run = [&](const std::string& why, const std::string& what) {
    auto it = std::find_if(not_run.begin(), not_run.end(), [&](const auto& entry) { return entry.first == why; });
    if (it == not_run.end()) it = not_run.insert(not_run.end(), {why, {}});
    if (std::find(it->second.begin(), it->second.end(), what) == it->second.end()) it->second.push_back(what);
  };
  for (const std::string& arch : s.archs)
    for (int n : tokens) {
      const std::string kind_why = kind_not_run(arch);
      if (const std::string why = kind_why.empty() ? length_not_run(arch, n) : kind_why; !why.empty()) {
        if (args.json)
          fmt::print("{{\"bench\":\"route_not_run\",\"arch\":\"{}\",\"tokens\":{},\"why\":{}}}\n", arch, n,
                     nlohmann::json(why).dump());
        add_not_run(why, kind_why.empty() ? fmt::format("{} at {} tokens", arch, n) : arch);
        continue;
      }
      for (const std::string& name : s.routes)
        if (const std::string why = route_not_run(arch, n, name); !why.empty()) {
          if (args.json)
            fmt::print("{{\"bench\":\"route_not_run\",\"arch\":\"{}\",\"tokens\":{},\"route\":\"{}\",\"why\":{}}}\n",
                       arch, n, name, nlohmann::json(why).dump());
          // The remote route's and the resident routes' reasons hold at every length: name the arch alone.
          add_not_run(fmt::format("{} route not run: {}", name, why),
                      name == "remote" || is_resident(name) ? arch : fmt::format("{} at {} tokens", arch, n));
        }
    }
  if (!args.json) {
    if (!phase_rows.empty()) {
      fmt::print(
          "\nwhere overhead_ms goes: serve's phases: line, medians in ms (provider - prefill: a per-request "
          "provider's start, model load and exit; a resident one's round trip on its channel, and the region "
          "when it was sent)\n{:<7} {:<15} {:>6} {:>9} {:>9} {:>10} {:>8} {:>10} {:>16} {:>9} {:>11} {:>11}\n",
          "arch", "route", "tokens", "tokenize", "share", "provider", "region", "prefill", "provider-prefill", "adopt",
          "first_token", "overhead");
      for (const std::string& row : phase_rows) fmt::print("{}\n", row);
      fmt::print(
          "(adopt is the restore on the file routes; first_token = first byte - the phases before it, at serve)\n");
    }
    for (const auto& [why, what] : not_run) fmt::print("{}: {}\n", fmt::join(what, ", "), why);
    for (const std::string& note : notes) fmt::print("{}\n", note);
    for (const Paired& p : paired)
      if (p.has_saved)
        fmt::print(
            "{} {} tokens: file - shared overhead_ms per round, median {:.1f} ms; target >= half the file "
            "handoff ({:.1f} ms): {}\n",
            p.arch, p.tokens, p.saved, p.file_handoff / 2, p.saved >= p.file_handoff / 2 ? "met" : "missed");
    for (const Paired& p : paired)
      if (p.has_remote)
        fmt::print(
            "{} {} tokens: remote - shared overhead_ms per round, median {:.1f} ms (what the receiver process, "
            "the provider server's HTTP hop and UCX tcp add to the shared route)\n",
            p.arch, p.tokens, p.remote_added);
    for (const Paired& p : paired)
      for (const auto& [handoff, saved] : p.resident_saved) {
        const double outside = p.outside.count(handoff) ? p.outside.at(handoff) : 0.0;
        fmt::print(
            "{} {} tokens: first byte saved by a resident provider ({} - {}_resident per round), median {:.1f} "
            "ms [{:.1f}..{:.1f}]; the per-request provider's start, model load and exit {:.1f} ms; the model's "
            "load {:.1f} ms: target saved >= load {}\n",
            p.arch, p.tokens, handoff, handoff, saved.median, saved.p25, saved.p75, outside, p.model_load,
            p.model_load <= 0              ? "(no load figure)"
            : saved.median >= p.model_load ? "met"
                                           : "missed");
      }
    for (const std::string& arch : s.archs)
      for (const char* name : {"shared", "shared_resident", "file_resident"}) {
        std::map<int, double> overhead;  // tokens -> median, lengths the route ran at
        for (const Paired& p : paired)
          if (p.arch == arch && p.overhead.count(name)) overhead[p.tokens] = p.overhead.at(name);
        if (overhead.empty()) continue;
        const bool is_resident_route = is_resident(name);
        if (is_resident_route)
          fmt::print("{} {} overhead_ms at {} tokens: {:.1f} ms{}\n", arch, name, overhead.begin()->first,
                     overhead.begin()->second,
                     name == std::string("shared_resident") && overhead.begin()->first == 307
                         ? fmt::format(" (target <= 10: {})", overhead.begin()->second <= 10 ? "met" : "missed")
                         : "");
        if (overhead.size() >= 2 && overhead.begin()->second > 0)
          fmt::print("{} {} overhead_ms {} / {} tokens: {:.2f}x{}\n", arch, name, overhead.rbegin()->first,
                     overhead.begin()->first, overhead.rbegin()->second / overhead.begin()->second,
                     name == std::string("file_resident") ? "" : " (target <= 1.5)");
      }
  }
  stop_setup();
  return 0;
}

const bool registered = add_group({
    "route",
    "kvshare-serve end to end, paired rounds of --device cpu / file / shared / remote / file and shared with a "
    "resident "
    "provider on the same prompts: first byte, overhead_ms (first byte - the provider's prefill_ms) and serve's "
    "phases, "
    "per memory kind with --arch; --backend PATH for another decoder (llama-server)",
    register_all,
    report,
    {
        {"--backend", "PATH", "the decoder (default kvshare-decoder; a patched llama-server)"},
        {"--provider", "PATH", "the provider (default kvshare-prefill, or llama-kvshare-prefill beside --backend)"},
        {"--arch", "qwen3|qwen2|llama|mamba2|lfm2|qwen35|gemma3[,...]",
         "kvshare-mkmodel archs, one memory kind each, measured one after the other (default qwen3; repeatable)"},
        {"--rounds", "N", "paired rounds per length and arch (default 9; 5 with more than one arch)"},
        {"--routes", "cpu|file|shared|remote|file_resident|shared_resident[,...]",
         "the routes measured side by side (default all; the resident ones need a provider with --serve-fd)"},
        {"--model", "tiny|100m",
         "the generated model: the tiny default, or ~100M parameters (first byte with a real "
         "model load)"},
    },
    {307, 4096},
    {16},
});

}  // namespace
}  // namespace kvshare::bench
