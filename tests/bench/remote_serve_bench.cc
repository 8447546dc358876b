// kvshare-bench remote-serve: the remote route through kvshare-serve, beside the decoder
// alone (issue #44). Two serves on one generated model, each with its own decoder: "cpu"
// (--device cpu: the decoder prefills) and "remote" (--device hybrid --prefill-remote to a
// kvshare-provider-server on loopback, --handoff always, UCX over tcp). Where the machine
// has two cores the prefill host is pinned to core 1 and both serves with their decoders to
// core 0: the provider stands for another host.
//
// chat: a round is a conversation of two turns on each serve, in an order that rotates per
// round: turn 1 a long prompt (--tokens), turn 2 the same text and a short follow-up (the
// decoder's slot holds turn 1; the remote route moves only the suffix). Per turn: the first
// byte on each serve, their ratio paired per round, and the KV bytes the remote route moved
// (its log line's).
// clients: --clients concurrent clients (default 16), each one prompt of --client-tokens,
// sent at once to "cpu" with -np 1 and to "remote" with -np --slots (default 4; a
// kvshare-decoder backend serves one slot, so give --backend a patched llama-server for 4):
// the wall time until every reply is in and the median first byte.
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <map>
#include <regex>
#include <thread>

#include "bench_completion.h"
#include "bench_files.h"
#include "bench_registry.h"
#include "bench_serve.h"
#include "bench_stats.h"
#include "kvshare/share/spawn.h"
#include "route/decoder_client.h"
#include "route/decoder_process.h"

namespace kvshare::bench {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct Settings {
  fs::path backend;
  int rounds = 3;
  int tokens = 1000;  // turn 1's prompt
  int clients = 16;
  int client_tokens = 200;  // each client's prompt
  int slots = 4;            // the remote serve's -np in the clients case
  int layers = 8;
  bool pin = false;
};

Settings& settings() {
  static Settings s;
  return s;
}

// The prefill host: kvshare-provider-server on a free loopback port, pinned to core 1.
struct PrefillHost {
  ChildProcess process;
  fs::path log;
  std::string url;
  ~PrefillHost() { process.terminate(std::chrono::seconds(10)); }
};

std::unique_ptr<PrefillHost> start_prefill_host(const fs::path& dir, const fs::path& model, std::string& why) {
  auto host = std::make_unique<PrefillHost>();
  host->log = dir / "provider-server.log";
  std::vector<std::string> argv;
  if (settings().pin) argv = {"taskset", "-c", "1"};
  argv.insert(argv.end(), {bin("kvshare-provider-server").string(), "-m", model.string(), "--host", "127.0.0.1",
                           "--port", "0", "-t", "1", "--no-api-key", "--parallel", "1", "--queue", "64"});
  SpawnOptions options;
  options.stderr_path = host->log.string();
  options.die_with_parent = true;
  options.env = {"UCX_TLS=tcp"};
  auto child = ChildProcess::spawn(argv, options);
  if (!child) {
    why = child.error().what();
    return nullptr;
  }
  host->process = std::move(*child);
  if (auto url = wait_for_log(host->log, std::regex(R"(listening on (http://127\.0\.0\.1:\d+))"), host->process)) {
    host->url = *url;
    return host;
  }
  why = fmt::format("kvshare-provider-server did not start: {}", last_log_line(host->log));
  return nullptr;
}

// A serve started from a thread pinned to core 0 (its children inherit the mask).
std::unique_ptr<ServeUnderTest> start_pinned_serve(const ServeLaunch& launch, const fs::path& dir, std::string& why) {
  cpu_set_t before;
  const bool pinned = settings().pin && ::sched_getaffinity(0, sizeof before, &before) == 0;
  if (pinned) {
    cpu_set_t core0;
    CPU_ZERO(&core0);
    CPU_SET(0, &core0);
    ::sched_setaffinity(0, sizeof core0, &core0);
  }
  auto serve = start_serve(launch, dir, why);
  if (pinned) ::sched_setaffinity(0, sizeof before, &before);
  return serve;
}

struct Setup {
  fs::path dir;
  fs::path model;
  std::unique_ptr<PrefillHost> host;
  std::string why;
};

bool g_setup_started = false;

Setup& setup() {
  g_setup_started = true;
  static Setup s = [] {
    Setup made;
    auto model = make_bench_model("kvshare-bench-remote-serve", {settings().backend, bin("kvshare-provider-server")},
                                  made.why, {"--layers", std::to_string(settings().layers)});
    if (!model) return made;
    made.dir = model->dir;
    made.model = model->model;
    made.host = start_prefill_host(made.dir, made.model, made.why);
    return made;
  }();
  return s;
}

std::unique_ptr<ServeUnderTest> start_one(const std::string& name, int n_slots, std::string& why) {
  Setup& s = setup();
  ServeLaunch launch;
  launch.name = fmt::format("{}-np{}", name, n_slots);
  launch.args = {"-m",        s.model.string(),
                 "--backend", settings().backend.string(),
                 "-c",        "8192",
                 "-fa",       "on",
                 "-ctk",      "f16",
                 "-ctv",      "f16",
                 "-np",       std::to_string(n_slots)};
  if (name == "cpu") {
    launch.args.insert(launch.args.end(), {"--device", "cpu"});
  } else {
    launch.args.insert(launch.args.end(), {"--device", "hybrid", "--prefill-remote", s.host->url, "--handoff",
                                           name == "auto" ? "auto" : "always"});
    launch.env = {"UCX_TLS=tcp"};
  }
  // The decoder's own flags: one thread, as the prefill host has.
  launch.args.insert(launch.args.end(), {"--", "-t", "1"});
  return start_pinned_serve(launch, s.dir, why);
}

// The remote serve's lines: bytes moved and tokens cached, in order.
struct RemoteLine {
  size_t n_cached = 0;
  uint64_t bytes = 0;
};
std::vector<RemoteLine> remote_lines(const fs::path& log_path) {
  const std::regex line_re(
      R"(hybrid: \d+ prompt tokens(, (\d+) cached)?[^:]*: prefill .* remote from \S+ \((\d+) bytes\))");
  const std::string log = read_all(log_path);
  std::vector<RemoteLine> out;
  for (std::sregex_iterator it(log.begin(), log.end(), line_re), end; it != end; ++it)
    out.push_back({(*it)[2].matched ? std::stoul((*it)[2]) : 0, std::stoull((*it)[3])});
  return out;
}

// The newest remote line once there are more than `before` (the pipe to the log may lag).
Result<RemoteLine> next_remote_line(const fs::path& log_path, size_t before) {
  for (int i = 0; i < 1000; ++i) {
    auto lines = remote_lines(log_path);
    if (lines.size() > before) return lines.back();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return fail(EPROTO, "no remote handoff line in {}: {}", log_path.string(), last_log_line(log_path));
}

struct ChatSamples {
  std::map<std::string, std::vector<double>> first_byte_ms[2];  // per turn, per serve
  std::vector<double> ratio[2];                                 // remote / cpu, per round
  std::vector<double> auto_ratio[2];                            // auto / cpu, per round
  int auto_handed_off[2] = {};                                  // rounds in which auto handed the turn off
  std::vector<double> bytes[2];                                 // KV bytes the remote route moved
  std::vector<double> cached[2];
};
ChatSamples g_chat;

void bm_chat(benchmark::State& state) {
  Setup& s = setup();
  if (!s.why.empty()) return state.SkipWithError(s.why.c_str());
  std::string why;
  std::map<std::string, std::unique_ptr<ServeUnderTest>> serves;
  const char* const names[] = {"cpu", "remote", "auto"};
  for (const char* name : names)
    if (!(serves[name] = start_one(name, 1, why))) return state.SkipWithError(why.c_str());
  const route::DecoderClient decoder("127.0.0.1", serves["cpu"]->decoder_port, std::chrono::seconds(120));
  int round = 0;
  for (auto _ : state) {
    const std::string first = prompt_of(decoder, settings().tokens, 1000 + round);
    const std::string turns[2] = {first, first + " And now, in one short line: what follows from that?"};
    std::map<std::string, double> first_byte[2];
    double round_ms = 0;
    for (int k = 0; k < 3; ++k) {
      const std::string name = names[(round + k) % 3];
      for (int turn = 0; turn < 2; ++turn) {
        const size_t before = remote_lines(serves[name]->stderr_path).size();
        auto reply = stream_completion(serves[name]->port, turns[turn], 8);
        if (!reply)
          return state.SkipWithError(fmt::format("{} turn {}: {}", name, turn + 1, reply.error().what()).c_str());
        first_byte[turn][name] = reply->first_byte_ms;
        g_chat.first_byte_ms[turn][name].push_back(reply->first_byte_ms);
        if (name == "auto") {
          // The hybrid line is written before the first byte goes out.
          if (remote_lines(serves[name]->stderr_path).size() > before) ++g_chat.auto_handed_off[turn];
          continue;
        }
        if (name == "cpu") continue;
        round_ms += reply->first_byte_ms;
        auto line = next_remote_line(serves[name]->stderr_path, before);
        if (!line) return state.SkipWithError(line.error().what().c_str());
        g_chat.bytes[turn].push_back(static_cast<double>(line->bytes));
        g_chat.cached[turn].push_back(static_cast<double>(line->n_cached));
      }
    }
    for (int turn = 0; turn < 2; ++turn) {
      g_chat.ratio[turn].push_back(first_byte[turn]["remote"] / first_byte[turn]["cpu"]);
      g_chat.auto_ratio[turn].push_back(first_byte[turn]["auto"] / first_byte[turn]["cpu"]);
    }
    state.SetIterationTime(round_ms / 1e3);
    ++round;
  }
}

struct ClientsSamples {
  std::map<std::string, std::vector<double>> wall_ms, first_byte_p50;
  std::vector<double> ratio;  // remote / cpu wall, per round
  std::map<std::string, int> n_slots;
};
ClientsSamples g_clients;

// Every client at once; the wall time until the last reply is in, and the median first byte.
Result<std::pair<double, double>> clients_at_once(const ServeUnderTest& serve,
                                                  const std::vector<std::string>& prompts) {
  const auto start = Clock::now();
  std::vector<std::future<Result<StreamedCompletion>>> replies;
  for (const std::string& prompt : prompts)
    replies.push_back(
        std::async(std::launch::async, [&serve, prompt] { return stream_completion(serve.port, prompt, 8); }));
  std::vector<double> first_bytes;
  for (auto& reply : replies) {
    auto got = reply.get();
    if (!got) return fail(got.error());
    first_bytes.push_back(got->first_byte_ms);
  }
  return std::pair{std::chrono::duration<double, std::milli>(Clock::now() - start).count(), median(first_bytes)};
}

void bm_clients(benchmark::State& state) {
  Setup& s = setup();
  if (!s.why.empty()) return state.SkipWithError(s.why.c_str());
  const bool one_slot_backend = settings().backend.filename() == "kvshare-decoder";
  g_clients.n_slots = {{"cpu", 1}, {"remote", one_slot_backend ? 1 : settings().slots}};
  std::string why;
  std::map<std::string, std::unique_ptr<ServeUnderTest>> serves;
  for (const auto& [name, n] : g_clients.n_slots)
    if (!(serves[name] = start_one(name, n, why))) return state.SkipWithError(why.c_str());
  const route::DecoderClient decoder("127.0.0.1", serves["cpu"]->decoder_port, std::chrono::seconds(120));
  int round = 0;
  for (auto _ : state) {
    std::vector<std::string> prompts;
    for (int c = 0; c < settings().clients; ++c)
      prompts.push_back(prompt_of(decoder, settings().client_tokens, 5000 + round * 100 + c));
    std::map<std::string, double> wall;
    for (int k = 0; k < 2; ++k) {
      const std::string name = (round + k) % 2 == 0 ? "cpu" : "remote";
      auto result = clients_at_once(*serves[name], prompts);
      if (!result) return state.SkipWithError(fmt::format("{}: {}", name, result.error().what()).c_str());
      wall[name] = result->first;
      g_clients.wall_ms[name].push_back(result->first);
      g_clients.first_byte_p50[name].push_back(result->second);
    }
    g_clients.ratio.push_back(wall["remote"] / wall["cpu"]);
    state.SetIterationTime(wall["remote"] / 1e3);
    ++round;
  }
}

void register_all(const BenchArgs& args) {
  Settings& s = settings();
  s.backend = bin("kvshare-decoder");
  for (size_t i = 0; i + 1 < args.rest.size(); ++i) {
    const std::string& flag = args.rest[i];
    const std::string& value = args.rest[i + 1];
    if (flag == "--backend") s.backend = value, ++i;
    if (flag == "--rounds") s.rounds = std::max(1, std::atoi(value.c_str())), ++i;
    if (flag == "--clients") s.clients = std::max(1, std::atoi(value.c_str())), ++i;
    if (flag == "--client-tokens") s.client_tokens = std::max(2, std::atoi(value.c_str())), ++i;
    if (flag == "--slots") s.slots = std::max(1, std::atoi(value.c_str())), ++i;
  }
  if (!args.tokens.empty()) s.tokens = args.tokens.front();
  s.pin = std::thread::hardware_concurrency() >= 2 && ::access("/usr/bin/taskset", X_OK) == 0;
  if (args.smoke) s.rounds = 1, s.tokens = 100, s.clients = 3, s.client_tokens = 20, s.layers = 2;
  benchmark::RegisterBenchmark("remote-serve/chat", bm_chat)
      ->Iterations(s.rounds)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("remote-serve/clients", bm_clients)
      ->Iterations(s.rounds)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}

std::string spread_cell(const std::vector<double>& values) {
  const Spread s = spread_of(values);
  return fmt::format("{:.1f} [{:.1f}..{:.1f}]", s.median, s.p25, s.p75);
}

int report(const std::vector<RunResult>& runs, const BenchArgs& args) {
  const Settings& s = settings();
  const bool chat = !g_chat.ratio[0].empty();
  const bool clients = !g_clients.ratio.empty();
  if (chat) {
    if (args.json) {
      for (int turn = 0; turn < 2; ++turn)
        fmt::print(
            "{{\"bench\":\"remote-serve\",\"case\":\"chat\",\"turn\":{},\"tokens\":{},\"cpu_first_byte_ms\":{:.3f},"
            "\"remote_first_byte_ms\":{:.3f},\"ratio\":{:.3f},\"auto_first_byte_ms\":{:.3f},\"auto_ratio\":{:.3f},"
            "\"auto_handed_off_rounds\":{},\"kv_bytes\":{:.0f},\"cached\":{:.0f},\"pinned\":{}}}\n",
            turn + 1, s.tokens, median(g_chat.first_byte_ms[turn]["cpu"]), median(g_chat.first_byte_ms[turn]["remote"]),
            median(g_chat.ratio[turn]), median(g_chat.first_byte_ms[turn]["auto"]), median(g_chat.auto_ratio[turn]),
            g_chat.auto_handed_off[turn], median(g_chat.bytes[turn]), median(g_chat.cached[turn]), s.pin);
    } else {
      fmt::print(
          "\nremote-serve chat (decoder {}, a generated model of {} layers, turn 1 {} tokens, {} rounds; {})\n"
          "{:>4} {:>24} {:>24} {:>8} {:>24} {:>8} {:>12} {:>10} {:>8}\n",
          s.backend.filename().string(), s.layers, s.tokens, g_chat.ratio[0].size(),
          s.pin ? "serves on core 0, the prefill host on core 1" : "not pinned", "turn", "cpu first byte ms",
          "always first byte ms", "x cpu", "auto first byte ms", "x cpu", "auto handoffs", "KV bytes", "cached");
      for (int turn = 0; turn < 2; ++turn)
        fmt::print("{:>4} {:>24} {:>24} {:>8.2f} {:>24} {:>8.2f} {:>12} {:>10.0f} {:>8.0f}\n", turn + 1,
                   spread_cell(g_chat.first_byte_ms[turn]["cpu"]), spread_cell(g_chat.first_byte_ms[turn]["remote"]),
                   median(g_chat.ratio[turn]), spread_cell(g_chat.first_byte_ms[turn]["auto"]),
                   median(g_chat.auto_ratio[turn]),
                   fmt::format("{}/{}", g_chat.auto_handed_off[turn], g_chat.ratio[turn].size()),
                   median(g_chat.bytes[turn]), median(g_chat.cached[turn]));
      fmt::print("turn 2 moved {:.1f}% of turn 1's KV bytes\n",
                 100.0 * median(g_chat.bytes[1]) / median(g_chat.bytes[0]));
    }
  }
  if (clients) {
    if (args.json) {
      fmt::print(
          "{{\"bench\":\"remote-serve\",\"case\":\"clients\",\"clients\":{},\"tokens\":{},\"cpu_np\":1,\"remote_np\":{}"
          ","
          "\"cpu_wall_ms\":{:.3f},\"remote_wall_ms\":{:.3f},\"ratio\":{:.3f},\"cpu_first_byte_p50_ms\":{:.3f},"
          "\"remote_first_byte_p50_ms\":{:.3f},\"pinned\":{}}}\n",
          s.clients, s.client_tokens, g_clients.n_slots["remote"], median(g_clients.wall_ms["cpu"]),
          median(g_clients.wall_ms["remote"]), median(g_clients.ratio), median(g_clients.first_byte_p50["cpu"]),
          median(g_clients.first_byte_p50["remote"]), s.pin);
    } else {
      fmt::print("\nremote-serve clients ({} clients at once, {} tokens each, {} rounds)\n{:>22} {:>26} {:>26}\n",
                 s.clients, s.client_tokens, g_clients.ratio.size(), "", "all replies in (ms)", "first byte p50 (ms)");
      fmt::print("{:>22} {:>26} {:>26}\n", "cpu, -np 1", spread_cell(g_clients.wall_ms["cpu"]),
                 spread_cell(g_clients.first_byte_p50["cpu"]));
      fmt::print("{:>22} {:>26} {:>26}\n", fmt::format("remote, -np {}", g_clients.n_slots["remote"]),
                 spread_cell(g_clients.wall_ms["remote"]), spread_cell(g_clients.first_byte_p50["remote"]));
      fmt::print("remote / cpu, all replies in, paired per round: {:.2f}\n", median(g_clients.ratio));
    }
  }
  if (g_setup_started) {
    Setup& made = setup();
    made.host.reset();
    std::error_code ec;
    if (!made.dir.empty()) fs::remove_all(made.dir, ec);
  }
  return runs.empty() ? 1 : 0;
}

const bool registered = add_group({
    "remote-serve",
    "the remote route through kvshare-serve beside the decoder alone: a chat's turn 2 (first byte, KV bytes moved) "
    "and many clients at once (-np 1 alone against the remote route's slots)",
    register_all,
    report,
    {
        {"--backend", "PATH", "the decoder (default kvshare-decoder; a patched llama-server for --slots > 1)"},
        {"--rounds", "N", "rounds of each case (default 3)"},
        {"--clients", "N", "concurrent clients (default 16)"},
        {"--client-tokens", "N", "each client's prompt (default 200)"},
        {"--slots", "N", "the remote serve's -np in the clients case (default 4)"},
    },
    {1000},
    {100},
});

}  // namespace
}  // namespace kvshare::bench
