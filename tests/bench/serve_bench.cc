// kvshare-bench serve: what kvshare-serve itself adds to a streamed reply. One
// `kvshare-serve --device cpu` (no handoff: serve only forwards) with its kvshare-decoder;
// each round sends the same streamed completions once to serve and once to that decoder
// directly, the order alternating, with 1 and with 32 clients at a time, each request on a
// new connection, and with 1 client that keeps its connection (as OpenAI's SDKs do). Per request the
// time to the first body byte and the mean gap between SSE events after it (the
// inter-token gap a user sees); the report gives p50 and p99 over requests of each path
// and what serve adds at p50 (target <= 0.5 ms) and p99.
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <thread>

#include "bench_files.h"
#include "bench_registry.h"
#include "bench_stats.h"
#include "kvshare/share/spawn.h"
#include "route/decoder_process.h"
#include "route/upstream_stream.h"

namespace kvshare::bench {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct Setup {
  fs::path dir;
  ChildProcess serve;
  int serve_port = 0;
  int decoder_port = 0;
  std::string why;  // empty when ready
  ~Setup() { serve.terminate(std::chrono::seconds(10)); }
};

bool g_setup_started = false;

Setup& setup() {
  g_setup_started = true;
  static Setup s;
  static bool done = false;
  if (done) return s;
  done = true;
  for (const char* tool : {"kvshare-serve", "kvshare-decoder", "kvshare-mkmodel"})
    if (!fs::exists(bin(tool))) {
      s.why = fmt::format("{} not built", tool);
      return s;
    }
  auto dir = route::make_private_dir("kvshare-bench-serve");
  auto port = route::pick_free_loopback_port();
  if (!dir || !port) {
    s.why = !dir ? dir.error().what() : port.error().what();
    return s;
  }
  s.dir = *dir;
  s.serve_port = *port;
  const fs::path model = s.dir / "tiny.gguf";
  if (std::system(
          fmt::format("{} {} --ctx 4096 --seed 3 > /dev/null 2>&1", bin("kvshare-mkmodel").string(), model.string())
              .c_str()) != 0) {
    s.why = "kvshare-mkmodel failed";
    return s;
  }
  const fs::path log = s.dir / "serve.log";
  SpawnOptions options;
  options.stderr_path = log.string();
  options.die_with_parent = true;
  auto child =
      ChildProcess::spawn({bin("kvshare-serve").string(), "-m", model.string(), "--device", "cpu", "--backend",
                           bin("kvshare-decoder").string(), "--port", std::to_string(s.serve_port), "-c", "4096"},
                          options);
  if (!child) {
    s.why = child.error().what();
    return s;
  }
  s.serve = std::move(*child);
  const std::regex decoder_re(R"(decoder \S+ on 127\.0\.0\.1:(\d+))");
  for (int i = 0; i < 1200; ++i) {
    std::smatch match;
    const std::string text = read_all(log);
    if (std::regex_search(text, match, decoder_re) && text.find("listening on") != std::string::npos) {
      s.decoder_port = std::stoi(match[1]);
      return s;
    }
    if (s.serve.poll_exit()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  s.why = fmt::format("kvshare-serve did not start (log {})", log.string());
  return s;
}

struct Samples {
  std::vector<double> first_byte_ms;
  std::vector<double> gap_ms;
};

std::string completion_body(int salt) {
  return nlohmann::json{{"prompt", fmt::format("{} tell me a story about the sea", salt)},
                        {"max_tokens", 16},
                        {"temperature", 0},
                        {"stream", true}}
      .dump();
}

// Events, not reads: several SSE events often arrive in one read, so the gap is the
// stream's time after its first byte over the events that followed it.
size_t events_in(std::string_view text) {
  size_t count = 0;
  for (size_t at = text.find("data:"); at != std::string::npos; at = text.find("data:", at + 5)) ++count;
  return count;
}

void record(Samples& out, std::mutex& mutex, Clock::time_point start, Clock::time_point first_at,
            Clock::time_point last, size_t events) {
  const std::lock_guard lock(mutex);
  out.first_byte_ms.push_back(std::chrono::duration<double, std::milli>(first_at - start).count());
  if (events > 1)
    out.gap_ms.push_back(std::chrono::duration<double, std::milli>(last - first_at).count() /
                         static_cast<double>(events - 1));
}

// One streamed completion to `port` on a new connection; appends its first byte and its
// gaps to `out`.
bool one_stream(int port, int salt, Samples& out, std::mutex& mutex) {
  route::UpstreamStream::Request request;
  request.host = "127.0.0.1";
  request.port = port;
  request.method = "POST";
  request.path = "/v1/completions";
  request.body = completion_body(salt);
  const auto start = Clock::now();
  auto stream = route::UpstreamStream::start(request, nullptr);
  std::string piece;
  if (!stream->wait_head().has_value() || !stream->next(piece)) return false;
  const auto first_at = Clock::now();
  size_t events = events_in(piece);
  auto last = first_at;
  while (stream->next(piece)) {
    events += events_in(piece);
    last = Clock::now();
  }
  record(out, mutex, start, first_at, last, events);
  return true;
}

// The same on `client`'s kept connection (keep-alive on, opened by its first request).
bool one_stream_kept(httplib::Client& client, int salt, Samples& out, std::mutex& mutex) {
  httplib::Request call;
  call.method = "POST";
  call.path = "/v1/completions";
  call.body = completion_body(salt);
  call.set_header("Content-Type", "application/json");
  std::optional<Clock::time_point> first_at;
  Clock::time_point last;
  size_t events = 0;
  call.content_receiver = [&](const char* data, size_t length, uint64_t, uint64_t) {
    last = Clock::now();
    if (!first_at) first_at = last;
    events += events_in(std::string_view(data, length));
    return true;
  };
  const auto start = Clock::now();
  auto result = client.send(call);
  if (!result || result->status != 200 || !first_at) return false;
  record(out, mutex, start, *first_at, last, events);
  return true;
}

bool one_wave(int port, int clients, int& salt, Samples& out) {
  std::mutex mutex;
  std::atomic<bool> ok{true};
  std::vector<std::jthread> threads;
  for (int c = 0; c < clients; ++c)
    threads.emplace_back([&, my_salt = ++salt] {
      if (!one_stream(port, my_salt, out, mutex)) ok = false;
    });
  threads.clear();
  return ok;
}

void bm_serve(benchmark::State& state) {
  Setup& s = setup();
  if (!s.why.empty()) return state.SkipWithError(s.why.c_str());
  const int clients = static_cast<int>(state.range(0));
  const bool kept = state.range(1) != 0;  // one client, one kept connection per path
  httplib::Client kept_to_decoder("127.0.0.1", s.decoder_port), kept_to_serve("127.0.0.1", s.serve_port);
  for (httplib::Client* client : {&kept_to_decoder, &kept_to_serve}) {
    client->set_keep_alive(true);
    client->set_tcp_nodelay(true);
  }
  static int salt = 0;
  Samples direct, via_serve;
  std::vector<double> added_first_byte;  // per round: serve's wave median - the decoder's
  bool serve_first = false;
  for (auto _ : state) {
    double wave_median[2] = {0, 0};  // direct, serve
    for (int k = 0; k < 2; ++k) {
      const bool to_serve = (k == 0) == serve_first;
      Samples& into = to_serve ? via_serve : direct;
      const size_t before = into.first_byte_ms.size();
      std::mutex mutex;
      const bool ok = kept ? one_stream_kept(to_serve ? kept_to_serve : kept_to_decoder, ++salt, into, mutex)
                           : one_wave(to_serve ? s.serve_port : s.decoder_port, clients, salt, into);
      if (!ok) return state.SkipWithError("a streamed request got no reply");
      wave_median[to_serve ? 1 : 0] =
          percentile(std::vector<double>(into.first_byte_ms.begin() + static_cast<std::ptrdiff_t>(before),
                                         into.first_byte_ms.end()),
                     0.5);
    }
    added_first_byte.push_back(wave_median[1] - wave_median[0]);
    serve_first = !serve_first;
  }
  state.counters["added_first_byte_p25"] = percentile(added_first_byte, 0.25);
  state.counters["added_first_byte_p50"] = percentile(added_first_byte, 0.5);
  state.counters["added_first_byte_p75"] = percentile(added_first_byte, 0.75);
  for (const auto& [name, samples] : {std::pair<const char*, const Samples*>{"direct", &direct},
                                      std::pair<const char*, const Samples*>{"serve", &via_serve}}) {
    state.counters[std::string(name) + ".first_byte_p50"] = percentile(samples->first_byte_ms, 0.5);
    state.counters[std::string(name) + ".first_byte_p99"] = percentile(samples->first_byte_ms, 0.99);
    state.counters[std::string(name) + ".gap_p50"] = percentile(samples->gap_ms, 0.5);
    state.counters[std::string(name) + ".gap_p99"] = percentile(samples->gap_ms, 0.99);
    state.counters[std::string(name) + ".requests"] = static_cast<double>(samples->first_byte_ms.size());
  }
  state.counters["clients"] = clients;
  state.counters["kept"] = kept ? 1 : 0;
}

const bool registered = add_group({
    "serve",
    "what kvshare-serve --device cpu adds to first byte and inter-token gap (SSE), against its decoder directly, "
    "1 and 32 clients on new connections, 1 on a kept one",
    [](const BenchArgs& args) {
      for (auto [clients, kept] : {std::pair{1, 0}, std::pair{32, 0}, std::pair{1, 1}})
        benchmark::RegisterBenchmark(fmt::format("serve/clients:{}{}", clients, kept ? "/kept" : "").c_str(), bm_serve)
            ->Args({clients, kept})
            ->Iterations(args.smoke     ? 1
                         : clients == 1 ? 200
                                        : 6)
            ->Unit(benchmark::kMillisecond);
    },
    [](const std::vector<RunResult>& runs, const BenchArgs& args) {
      if (!args.json)
        fmt::print(
            "\nserve --device cpu vs its decoder directly (streamed /v1/completions, 16 tokens; rounds alternate "
            "the order)\n{:>7} {:>5} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}\n",
            "clients", "conn", "path", "requests", "fb_p50", "fb_p99", "gap_p50", "gap_p99", "+fb_p50", "+gap_p50",
            "+fb_p99");
      for (const RunResult* run : runs_with_prefix(runs, "serve/")) {
        auto c = [&](const std::string& key) { return run->counters.count(key) ? run->counters.at(key) : 0.0; };
        if (c("clients") == 0) continue;
        const char* connection = c("kept") != 0 ? "kept" : "new";
        const double added_fb = c("serve.first_byte_p50") - c("direct.first_byte_p50");
        const double added_gap = c("serve.gap_p50") - c("direct.gap_p50");
        const double added_fb99 = c("serve.first_byte_p99") - c("direct.first_byte_p99");
        for (const char* path : {"direct", "serve"}) {
          const std::string p = std::string(path) + ".";
          if (args.json)
            fmt::print(
                "{{\"bench\":\"serve\",\"clients\":{},\"connection\":\"{}\",\"path\":\"{}\",\"requests\":{},\"first_"
                "byte_p50_ms\":{:.3f},"
                "\"first_byte_p99_ms\":{:.3f},\"gap_p50_ms\":{:.3f},\"gap_p99_ms\":{:.3f},"
                "\"added_first_byte_paired_p50_ms\":{:.3f},\"added_first_byte_paired_p25_ms\":{:.3f},"
                "\"added_first_byte_paired_p75_ms\":{:.3f}}}\n",
                c("clients"), connection, path, c(p + "requests"), c(p + "first_byte_p50"), c(p + "first_byte_p99"),
                c(p + "gap_p50"), c(p + "gap_p99"), c("added_first_byte_p50"), c("added_first_byte_p25"),
                c("added_first_byte_p75"));
          else
            fmt::print("{:>7} {:>5} {:>8} {:>10} {:>10.3f} {:>10.3f} {:>10.3f} {:>10.3f} {:>10} {:>10} {:>10}\n",
                       c("clients"), connection, path, c(p + "requests"), c(p + "first_byte_p50"),
                       c(p + "first_byte_p99"), c(p + "gap_p50"), c(p + "gap_p99"),
                       path == std::string("serve") ? fmt::format("{:.3f}", added_fb) : "",
                       path == std::string("serve") ? fmt::format("{:.3f}", added_gap) : "",
                       path == std::string("serve") ? fmt::format("{:.3f}", added_fb99) : "");
        }
        if (!args.json)
          fmt::print(
              "{:>7} clients, {} connections: serve minus direct per round (median of each wave), median "
              "{:.3f} ms [{:.3f}..{:.3f}]\n",
              c("clients"), connection, c("added_first_byte_p50"), c("added_first_byte_p25"),
              c("added_first_byte_p75"));
      }
      if (!args.json) fmt::print("(ms; + columns: serve minus direct; target +p50 <= 0.5 ms)\n");
      if (g_setup_started) {
        Setup& s = setup();
        s.serve.terminate(std::chrono::seconds(10));
        std::error_code ec;
        if (!s.dir.empty()) fs::remove_all(s.dir, ec);
      }
      return 0;
    },
});

}  // namespace
}  // namespace kvshare::bench
