// kvshare-bench handoff: what one prompt's KV handoff costs by the share route (the fds of
// the decoder's already-exported cache go over the socket; listen + share + send +
// receive + validate + map + adopt, no prefill) against the file route (the same KV
// written as a llama.cpp state file by kvshare/statefile's writer and read back by its
// reader, fsync policy "none" as in the real handoff), for the Qwen3-Coder-30B-A3B shape
// (qwen3moe: 48 layers, 4 KV heads x 128, f16, flash attention on, -c 32768), side by side.
// Group flags (after --): --dir PATH for the state files (default $TMPDIR or /tmp).
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <vector>

#include "bench_files.h"
#include "bench_registry.h"
#include "bench_stats.h"
#include "kvshare/region/importer.h"
#include "kvshare/share/broker.h"
#include "kvshare/share/decoder_share.h"
#include "kvshare/statefile/state_file_reader.h"
#include "kvshare/statefile/state_file_writer.h"
#include "layout/share_header.h"
#include "qwen3_coder_shape.h"

namespace kvshare::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct Settings {
  std::filesystem::path dir;
  uint32_t n_ctx = 32768;
};

Settings& settings() {
  static Settings s;
  return s;
}

// The decoder with its cache exported once (startup cost, not per handoff).
DecoderShare& decoder() {
  static DecoderShare share = [] {
    ExportOptions options;
    options.forced = RegionBackend::memfd;
    return DecoderShare::start(qwen3_coder_header(settings().n_ctx), true, options);
  }();
  return share;
}

void record_median(benchmark::State& state, const std::vector<double>& ms) { state.counters["median_ms"] = median(ms); }

// One handoff by the share route. `route_ms` is share .. adopt (what the issue prices);
// `setup_ms` is the broker's listen before it and its cleanup (close, unlink, rmdir)
// after it, reported beside it so nothing is hidden.
Result<void> one_share_handoff(DecoderShare& share, uint64_t n_tokens, bool first, double& route_ms, double& setup_ms) {
  // `first`: the broker has not seen this decoder's header yet and parses it in full; after
  // that it recognises the same bytes and skips it (ShareBroker::receive).
  if (first) ShareBroker::forget_known_header();
  const auto listen_start = Clock::now();
  std::optional<ShareBroker> broker;
  {
    auto listening = ShareBroker::listen(settings().dir);
    if (!listening) return fail(listening.error());
    broker.emplace(std::move(*listening));
  }
  const auto start = Clock::now();
  {
    auto id = share.share(broker->socket_path(), 0, 5000);
    if (!id) return fail(id.error());
    auto received = broker->receive(5000);
    if (!received) return fail(received.error());
    // What the provider does with the fds: validate and map them with its own mapping.
    auto imported = ImportedShare::import(received->header.layout, std::move(received->fds), {}, true);
    if (!imported) return fail(imported.error());
    benchmark::DoNotOptimize(imported->chunk_bytes().data());
    auto plan = share.adopt(n_tokens, *id);
    if (!plan) return fail(plan.error());
    route_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  }
  const auto cleanup_start = Clock::now();
  broker.reset();
  setup_ms = std::chrono::duration<double, std::milli>(start - listen_start).count() +
             std::chrono::duration<double, std::milli>(Clock::now() - cleanup_start).count();
  return {};
}

void bm_shared(benchmark::State& state, bool first) {
  const auto n_tokens = static_cast<uint64_t>(state.range(0));
  DecoderShare& share = decoder();
  if (!share.can_share()) return state.SkipWithError(share.startup_warning().c_str());
  std::vector<double> ms, setup;
  for (auto _ : state) {
    double route_ms = 0, setup_ms = 0;
    if (auto done = one_share_handoff(share, n_tokens, first, route_ms, setup_ms); !done)
      return state.SkipWithError(done.error().what().c_str());
    state.SetIterationTime(route_ms / 1e3);
    ms.push_back(route_ms);
    setup.push_back(setup_ms);
  }
  std::sort(setup.begin(), setup.end());
  state.counters["setup_median_ms"] = setup.empty() ? 0 : setup[setup.size() / 2];
  record_median(state, ms);
}

void bm_file(benchmark::State& state) {
  const auto n_tokens = static_cast<uint32_t>(state.range(0));
  const auto& memory = decoder().header().memory;
  std::vector<uint16_t> rows(uint64_t{n_tokens} * 4 * 128, 0x3c00);  // f16 1.0: the cache's own type
  const statefile::RowsView view{layout::GgmlType::F16, rows.data(), n_tokens, 0};
  std::vector<int32_t> tokens(n_tokens, 1);
  const auto path = settings().dir / fmt::format("kvshare-handoff-bench-{}.bin", ::getpid());
  std::vector<double> ms;
  for (auto _ : state) {
    const auto start = Clock::now();
    auto writer = statefile::StateFileWriter::create(path, memory, tokens, static_cast<int32_t>(n_tokens));
    if (!writer) return state.SkipWithError(writer.error().what().c_str());
    for (uint32_t il = 0; il < 48; ++il)
      if (auto rc = writer->write_layer(il, view, view); !rc) return state.SkipWithError(rc.error().what().c_str());
    auto committed = writer->commit();
    if (!committed) return state.SkipWithError(committed.error().what().c_str());
    auto file = statefile::read_state_file(path, &memory);
    if (!file) return state.SkipWithError(file.error().what().c_str());
    benchmark::DoNotOptimize(file->tokens().data());
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    state.SetIterationTime(elapsed);
    ms.push_back(elapsed * 1e3);
  }
  std::error_code ec;
  std::filesystem::remove(path, ec);
  record_median(state, ms);
}

void register_all(const BenchArgs& args) {
  Settings& s = settings();
  s.dir = scratch_dir(args);
  if (args.smoke) s.n_ctx = 256;
  for (int n : args.tokens) {
    const int shared_iters = args.smoke ? 1 : 51;
    const int file_iters = args.smoke ? 1 : n <= 512 ? 21 : n <= 8192 ? 7 : 3;
    benchmark::RegisterBenchmark(fmt::format("handoff/shared/{}", n).c_str(),
                                 [](benchmark::State& state) { bm_shared(state, false); })
        ->Arg(n)
        ->Iterations(shared_iters)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(fmt::format("handoff/shared_first/{}", n).c_str(),
                                 [](benchmark::State& state) { bm_shared(state, true); })
        ->Arg(n)
        ->Iterations(shared_iters)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(fmt::format("handoff/file/{}", n).c_str(), bm_file)
        ->Arg(n)
        ->Iterations(file_iters)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
}

double counter(const std::vector<RunResult>& runs, const std::string& prefix, const char* name = "median_ms") {
  for (const RunResult* run : runs_with_prefix(runs, prefix))
    if (run->counters.count(name)) return run->counters.at(name);
  return 0;
}

int report(const std::vector<RunResult>& runs, const BenchArgs& args) {
  std::vector<int> tokens;
  for (const RunResult* run : runs_with_prefix(runs, "handoff/shared/"))
    tokens.push_back(std::stoi(run->name.substr(std::string("handoff/shared/").size())));
  const uint64_t per_token = layout::kv_bytes_per_token(decoder().header().memory);
  if (!args.json)
    fmt::print(
        "\nhandoff (Qwen3-Coder-30B-A3B shape: 48 layers, 4 KV heads x 128, f16, FA on, -c {}; share "
        "backend {}; state files in {})\n{:>7} {:>12} {:>11} {:>11} {:>11} {:>9} {:>15}\n",
        settings().n_ctx, decoder().backend_description(), settings().dir.string(), "tokens", "kv_bytes", "shared_ms",
        "first_ms", "file_ms", "file/shr", "listen+cleanup");
  double first_shared = 0, last_shared = 0;
  for (int n : tokens) {
    const double shared = counter(runs, fmt::format("handoff/shared/{}/", n));
    const double first = counter(runs, fmt::format("handoff/shared_first/{}/", n));
    const double file = counter(runs, fmt::format("handoff/file/{}/", n));
    const double setup = counter(runs, fmt::format("handoff/shared/{}/", n), "setup_median_ms");
    if (first_shared == 0) first_shared = shared;
    last_shared = shared;
    const uint64_t kv_bytes = per_token * static_cast<uint64_t>(n);
    if (args.json)
      fmt::print(
          "{{\"bench\":\"handoff\",\"tokens\":{},\"kv_bytes\":{},\"shared_ms\":{:.4f},\"shared_first_ms\":{:.4f},"
          "\"file_ms\":{:.3f},\"listen_cleanup_ms\":{:.4f}}}\n",
          n, kv_bytes, shared, first, file, setup);
    else
      fmt::print("{:>7} {:>12} {:>11.4f} {:>11.4f} {:>11.2f} {:>8.0f}x {:>15.3f}\n", n, kv_bytes, shared, first, file,
                 shared > 0 ? file / shared : 0, setup);
  }
  if (!args.json && first_shared > 0)
    fmt::print(
        "(medians; shared: a decoder's header already known to the broker, first_ms: parsed in full, as on "
        "a decoder's first handoff; targets: both < 1 ms at every length, last/first {:.2f} <= 1.5, "
        "file/shared >= 50 at 4096)\n",
        last_shared / first_shared);
  return 0;
}

const bool registered = add_group({
    "handoff",
    "share route (fds over the socket + map + adopt) vs file route (state file write + read), side by side",
    register_all,
    report,
    {
        {"--dir", "PATH", "where its files are written (default $TMPDIR, else /tmp)"},
    },
    {307, 4096, 32768},
    {16},
});

}  // namespace
}  // namespace kvshare::bench
