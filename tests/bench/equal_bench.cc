// kvshare-bench equal: what each route costs for the same work, from "the provider holds
// the prompt's K/V rows (f32, as computed) in its own buffers" to "the decoder can
// evaluate the next token", for the Qwen3-Coder-30B-A3B shape (48 layers, 4 KV heads x 128,
// f16 cache, flash attention on, -c 32768).
//
//   shared      listen, share (fds over the socket), receive, import with a fresh mapping
//               (a provider is a new process per request), scatter every layer into the
//               decoder's cells through the chunk descriptors (pwrite), adopt
//   shared_map  the same with the scatter through the fresh mapping (the route before
//               issue 16: one page fault per 4 KiB page on first touch)
//   file        the provider's writer (f32 -> f16 into its own buffers, serialize, write
//               the file), the decoder's read and validation of it, and the copy of every
//               section into its cache tensors (llama.cpp's restore)
//   resident    the shared route with a resident provider (issue 24): the provider mapped
//               the decoder's region once, before the rounds, and faulted it in
//               (populate_for_write), as kvshare-prefill --serve does at serve's region
//               request; per round, listen, share, receive and check
//               (the broker), region_key(share) against the held region's (equal: the fds
//               are dropped, the provider is not sent them again), scatter every layer through
//               the long-lived mapping, adopt
//   floor       the scatter alone, into the decoder's own warm mapping: the conversion and
//               copy every route must do once, whatever it hands over
//
// A route's added cost is its time less the floor's in the same round: what the handoff
// itself adds to writing the bytes. The floor has no first look (below); it is timed after
// the floor, apart (look_ms), since on warm pages it still reads one line of every 4 KiB page
// (its cost: docs/hybrid.md, "A resident provider"): a resident provider's added cost less
// it is the handoff's own. Every side ends with the decoder's own first look at its cells
// (one byte per 4 KiB page of the written rows, through its long-lived mapping), which is
// where a page the provider put in place but the decoder never mapped would show. The sides
// run in rounds (one of each per iteration), the order rotating each time, so a slow moment
// of a busy machine lands on every side alike; the report gives medians and quartiles of each
// side and of the per-round ratios of the added costs, shared / file and resident / file.
// Prompt lengths: --tokens N[,N...] (default 307, 4096, 32768; the decoder's -c is the
// longest of them, at least 32768). Group flags: --dir PATH for the state files (default
// $TMPDIR or /tmp); --rounds N per length (default 15 up to 512 tokens, 9 up to 8192, 5
// beyond: a 32768-token round writes and reads a 3 GiB state file).
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <map>
#include <optional>
#include <vector>

#include "bench_files.h"
#include "bench_registry.h"
#include "bench_stats.h"
#include "kvshare/region/importer.h"
#include "kvshare/region/populate.h"
#include "kvshare/scatter/scatter.h"
#include "kvshare/share/broker.h"
#include "kvshare/share/decoder_share.h"
#include "kvshare/statefile/state_file_reader.h"
#include "kvshare/statefile/state_file_writer.h"
#include "qwen3_coder_shape.h"

namespace kvshare::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kLayers = 48;
constexpr uint32_t kEmbdGqa = 4 * 128;

struct Settings {
  std::filesystem::path dir;
  uint32_t n_ctx = 32768;
  int rounds = 0;  // --rounds; 0: by length
};

Settings& settings() {
  static Settings s;
  return s;
}

// Minor page faults this process has taken so far (every thread): a side's delta is the
// first touches it paid for, the figure `perf stat -e page-faults` would give.
long minor_faults() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// The decoder: its cache exported once and touched once, as llama.cpp clears its KV
// buffers at start, so its own mapping is warm before any handoff.
DecoderShare& decoder() {
  static DecoderShare share = [] {
    ExportOptions options;
    options.forced = RegionBackend::memfd;
    DecoderShare made = DecoderShare::start(qwen3_coder_header(settings().n_ctx), true, options);
    for (std::span<std::byte> chunk : made.chunk_bytes()) std::memset(chunk.data(), 0, chunk.size());
    return made;
  }();
  return share;
}

// One layer's rows as a provider computes them: token t's K then V, f32, one buffer
// standing in for every layer (the bytes written are the same; the memory is 48x less).
struct ProviderRows {
  explicit ProviderRows(uint32_t n_tokens) : values(uint64_t{n_tokens} * 2 * kEmbdGqa) {
    for (size_t i = 0; i < values.size(); ++i)
      values[i] = static_cast<float>((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
  }
  uint64_t row_stride() const { return 2 * kEmbdGqa * sizeof(float); }
  std::vector<float> values;
};

// The decoder reads one byte of every 4 KiB page of cells 0..n-1 in every K and V tensor.
Result<void> decoder_first_look(uint32_t n_tokens) {
  volatile unsigned sum = 0;
  for (uint32_t il = 0; il < kLayers; ++il)
    for (const char* kind : {"k", "v"}) {
      auto view = decoder().view(fmt::format("cache_{}_l{}", kind, il));
      if (!view) return fail(view.error());
      const uint64_t bytes = view->row_bytes * n_tokens;
      for (uint64_t at = 0; at < bytes; at += 4096) sum = sum + static_cast<unsigned>(view->base[at]);
    }
  return {};
}

enum class Side { shared, shared_map, resident, file, floor };
constexpr Side kSides[] = {Side::shared, Side::shared_map, Side::resident, Side::file, Side::floor};
constexpr size_t kSideCount = std::size(kSides);
const char* side_name(Side side) {
  switch (side) {
    case Side::shared:
      return "shared";
    case Side::shared_map:
      return "shared_map";
    case Side::resident:
      return "resident";
    case Side::file:
      return "file";
    case Side::floor:
      return "floor";
  }
  return "";
}

kvshare::ScatterBatch all_layers(const ProviderRows& rows, uint32_t n_tokens) {
  kvshare::ScatterBatch batch;
  for (uint32_t il = 0; il < kLayers; ++il) batch.layers.push_back({il, rows.values.data(), kEmbdGqa, kEmbdGqa});
  batch.n_tokens = n_tokens;
  batch.src_type = layout::GgmlType::F32;
  batch.row_stride = rows.row_stride();
  return batch;
}

// The floor's time; `look_ms` gets the decoder's first look after it, timed apart.
Result<double> floor_side(const ProviderRows& rows, uint32_t n_tokens, double& look_ms) {
  const layout::ShareHeader& header = decoder().header();
  const auto chunks = decoder().chunk_bytes();
  const auto start = Clock::now();
  kvshare::ScatterTarget target{
      header.layout, header.memory, std::vector<std::span<std::byte>>(chunks.begin(), chunks.end()), 0, 128, 128};
  if (auto scattered = kvshare::scatter(target, all_layers(rows, n_tokens)); !scattered) return fail(scattered.error());
  const double ms = ms_since(start);
  const auto look_start = Clock::now();
  if (auto looked = decoder_first_look(n_tokens); !looked) return fail(looked.error());
  look_ms = ms_since(look_start);
  return ms;
}

Result<double> shared_side(const ProviderRows& rows, uint32_t n_tokens, bool through_files) {
  DecoderShare& share = decoder();
  const auto start = Clock::now();
  std::optional<ShareBroker> broker;
  {
    auto listening = ShareBroker::listen(settings().dir);
    if (!listening) return fail(listening.error());
    broker.emplace(std::move(*listening));
  }
  auto id = share.share(broker->socket_path(), 0, 5000);
  if (!id) return fail(id.error());
  auto received = broker->receive(5000);
  if (!received) return fail(received.error());
  auto imported = ImportedShare::import(received->header.layout, std::move(received->fds), {}, true);
  if (!imported) return fail(imported.error());
  const auto chunks = imported->chunk_bytes();
  const layout::ShareHeader& header = share.header();
  kvshare::ScatterTarget target{
      header.layout, header.memory, std::vector<std::span<std::byte>>(chunks.begin(), chunks.end()),   0,
      128,           128,           through_files ? imported->chunk_files() : std::vector<ChunkFile>{}};
  if (auto scattered = kvshare::scatter(target, all_layers(rows, n_tokens)); !scattered) return fail(scattered.error());
  if (auto plan = share.adopt(n_tokens, *id); !plan) return fail(plan.error());
  if (auto looked = decoder_first_look(n_tokens); !looked) return fail(looked.error());
  const double ms = ms_since(start);
  broker.reset();  // the socket directory's cleanup, after the decoder could go on
  return ms;
}

// The decoder's region as a resident provider holds it: mapped from a share received once,
// pre-faulted, kept across every round, and the key serve compares each share against.
struct HeldRegion {
  RegionKey key;
  ImportedShare imported;
  double region_ms = 0;  // the import and pre-fault, paid once (the provider's region_ms)
};

// Made before the first round (outside any timing), from a share the decoder then leaves
// unadopted: the next round's share makes it stale, as a request after serve's region
// request does.
Result<HeldRegion*> held_region() {
  static std::optional<HeldRegion> held;
  if (held) return &*held;
  auto broker = ShareBroker::listen(settings().dir);
  if (!broker) return fail(broker.error());
  auto id = decoder().share(broker->socket_path(), 0, 5000);
  if (!id) return fail(id.error());
  auto received = broker->receive(5000);
  if (!received) return fail(received.error());
  const auto start = Clock::now();
  auto key = region_key(*received);
  if (!key) return fail(key.error());
  std::vector<uint64_t> offsets;
  for (const auto& entry : received->entries) offsets.push_back(entry.offset);
  auto imported = ImportedShare::import(received->header.layout, std::move(received->fds), offsets, true);
  if (!imported) return fail(imported.error());
  for (std::span<std::byte> chunk : imported->chunk_bytes())
    if (auto faulted = populate_for_write(chunk, "the held region"); !faulted) return fail(faulted.error());
  held.emplace(HeldRegion{std::move(*key), std::move(*imported), ms_since(start)});
  return &*held;
}

Result<double> resident_side(const ProviderRows& rows, uint32_t n_tokens, const HeldRegion& held) {
  DecoderShare& share = decoder();
  const auto start = Clock::now();
  std::optional<ShareBroker> broker;
  {
    auto listening = ShareBroker::listen(settings().dir);
    if (!listening) return fail(listening.error());
    broker.emplace(std::move(*listening));
  }
  auto id = share.share(broker->socket_path(), 0, 5000);
  if (!id) return fail(id.error());
  auto received = broker->receive(5000);
  if (!received) return fail(received.error());
  // serve's test before it asks the provider: the same region needs no region request.
  auto key = region_key(*received);
  if (!key) return fail(key.error());
  if (*key != held.key) return fail(ESTALE, "share {}: the decoder sent another region than the one held", *id);
  received->fds.clear();
  const auto chunks = held.imported.chunk_bytes();
  const layout::ShareHeader& header = share.header();
  kvshare::ScatterTarget target{
      header.layout, header.memory, std::vector<std::span<std::byte>>(chunks.begin(), chunks.end()), 0, 128, 128};
  if (auto scattered = kvshare::scatter(target, all_layers(rows, n_tokens)); !scattered) return fail(scattered.error());
  if (auto plan = share.adopt(n_tokens, *id); !plan) return fail(plan.error());
  if (auto looked = decoder_first_look(n_tokens); !looked) return fail(looked.error());
  const double ms = ms_since(start);
  broker.reset();  // the socket's cleanup, after the decoder could go on
  return ms;
}

Result<double> file_side(const ProviderRows& rows, uint32_t n_tokens, const std::filesystem::path& path) {
  const layout::MemoryShape& memory = decoder().header().memory;
  const std::vector<int32_t> tokens(n_tokens, 1);
  const auto start = Clock::now();
  {
    auto writer = statefile::StateFileWriter::create(path, memory, tokens, static_cast<int32_t>(n_tokens));
    if (!writer) return fail(writer.error());
    const float* k = rows.values.data();
    const statefile::RowsView k_rows{layout::GgmlType::F32, k, n_tokens, rows.row_stride()};
    const statefile::RowsView v_rows{layout::GgmlType::F32, k + kEmbdGqa, n_tokens, rows.row_stride()};
    for (uint32_t il = 0; il < kLayers; ++il)
      if (auto written = writer->write_layer(il, k_rows, v_rows); !written) return fail(written.error());
    if (auto committed = writer->commit(); !committed) return fail(committed.error());
  }
  auto file = statefile::read_state_file(path, &memory);
  if (!file) return fail(file.error());
  for (const layout::StateSection* section : file->sections()) {
    const char* kind = section->kind == layout::TensorKind::k ? "k" : "v";
    auto view = decoder().view(fmt::format("cache_{}_l{}", kind, section->il));
    if (!view) return fail(view.error());
    const std::span<const std::byte> bytes = file->section_bytes(*section);
    std::memcpy(view->base, bytes.data(), bytes.size());  // position-major: cells 0..n-1 in order
  }
  if (auto looked = decoder_first_look(n_tokens); !looked) return fail(looked.error());
  return ms_since(start);
}

void bm_equal(benchmark::State& state) {
  const auto n_tokens = static_cast<uint32_t>(state.range(0));
  if (!decoder().can_share()) return state.SkipWithError(decoder().startup_warning().c_str());
  const ProviderRows rows(n_tokens);
  const auto path = settings().dir / fmt::format("kvshare-equal-bench-{}.state", ::getpid());
  auto held = held_region();
  if (!held) return state.SkipWithError(held.error().what().c_str());
  std::map<Side, std::vector<double>> ms, faults;
  std::vector<double> shared_added, map_added, resident_added, file_added, added_ratio, resident_ratio, look,
      resident_own;
  size_t turn = 0;
  for (auto _ : state) {
    std::map<Side, double> round;
    double look_ms = 0;
    for (size_t k = 0; k < kSideCount; ++k) {
      const Side side = kSides[(turn + k) % kSideCount];
      const long faults_before = minor_faults();
      Result<double> took = side == Side::file       ? file_side(rows, n_tokens, path)
                            : side == Side::floor    ? floor_side(rows, n_tokens, look_ms)
                            : side == Side::resident ? resident_side(rows, n_tokens, **held)
                                                     : shared_side(rows, n_tokens, side == Side::shared);
      if (!took) return state.SkipWithError(took.error().what().c_str());
      round[side] = *took;
      faults[side].push_back(static_cast<double>(minor_faults() - faults_before));
    }
    ++turn;
    std::error_code ec;
    std::filesystem::remove(path, ec);
    state.SetIterationTime(round[Side::shared] / 1e3);
    for (Side side : kSides) ms[side].push_back(round[side]);
    shared_added.push_back(round[Side::shared] - round[Side::floor]);
    map_added.push_back(round[Side::shared_map] - round[Side::floor]);
    resident_added.push_back(round[Side::resident] - round[Side::floor]);
    look.push_back(look_ms);
    resident_own.push_back(resident_added.back() - look_ms);
    file_added.push_back(round[Side::file] - round[Side::floor]);
    added_ratio.push_back(shared_added.back() / file_added.back());
    resident_ratio.push_back(resident_added.back() / file_added.back());
  }
  for (Side side : kSides) {
    record_spread(state, std::string(side_name(side)) + "_ms", ms[side]);
    state.counters[std::string(side_name(side)) + "_faults"] = spread_of(faults[side]).median;
  }
  record_spread(state, "shared_added_ms", shared_added);
  record_spread(state, "shared_map_added_ms", map_added);
  record_spread(state, "resident_added_ms", resident_added);
  record_spread(state, "file_added_ms", file_added);
  record_spread(state, "added_ratio", added_ratio);
  record_spread(state, "resident_added_ratio", resident_ratio);
  record_spread(state, "look_ms", look);
  record_spread(state, "resident_own_ms", resident_own);
  state.counters["resident_region_ms"] = (*held)->region_ms;
  state.counters["rounds"] = static_cast<double>(state.iterations());
}

void register_all(const BenchArgs& args) {
  Settings& s = settings();
  s.dir = scratch_dir(args);
  for (size_t i = 0; i + 1 < args.rest.size(); ++i)
    if (args.rest[i] == "--rounds") s.rounds = std::max(1, std::atoi(args.rest[++i].c_str()));
  const std::vector<int>& tokens = args.tokens;
  if (args.smoke) s.n_ctx = 256;
  // A longer prompt than the default context gets a cache that holds it (llama.cpp pads
  // kv_size to 256).
  for (int n : tokens) s.n_ctx = std::max(s.n_ctx, (static_cast<uint32_t>(n) + 255) / 256 * 256);
  for (int n : tokens) {
    const int rounds = args.smoke ? 1 : s.rounds > 0 ? s.rounds : n <= 512 ? 15 : n <= 8192 ? 9 : 5;
    benchmark::RegisterBenchmark(fmt::format("equal/{}", n).c_str(), bm_equal)
        ->Arg(n)
        ->Iterations(rounds)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
}

double counter(const RunResult& run, const std::string& name) {
  return run.counters.count(name) ? run.counters.at(name) : 0.0;
}

int report(const std::vector<RunResult>& runs, const BenchArgs& args) {
  const uint64_t per_token = layout::kv_bytes_per_token(decoder().header().memory);
  const char* keys[] = {"shared_ms",      "shared_map_ms",   "resident_ms",          "file_ms",
                        "floor_ms",       "shared_added_ms", "shared_map_added_ms",  "resident_added_ms",
                        "file_added_ms",  "added_ratio",     "resident_added_ratio", "look_ms",
                        "resident_own_ms"};
  const std::vector<const RunResult*> measured = runs_with_prefix(runs, "equal/");
  auto tokens_of = [](const RunResult& run) { return std::stoi(run.name.substr(std::string("equal/").size())); };
  if (args.json) {
    for (const RunResult* run : measured) {
      auto c = [&](const std::string& key) { return counter(*run, key); };
      const int n = tokens_of(*run);
      fmt::print("{{\"bench\":\"equal\",\"tokens\":{},\"kv_bytes\":{},\"rounds\":{}", n,
                 per_token * static_cast<uint64_t>(n), c("rounds"));
      for (const char* key : keys)
        fmt::print(",\"{0}\":{1:.4f},\"{0}_p25\":{2:.4f},\"{0}_p75\":{3:.4f}", key, c(key),
                   c(std::string(key) + "_p25"), c(std::string(key) + "_p75"));
      for (Side side : kSides)
        fmt::print(",\"{}_faults\":{:.0f}", side_name(side), c(std::string(side_name(side)) + "_faults"));
      fmt::print(",\"resident_region_ms\":{:.3f}}}\n", c("resident_region_ms"));
    }
    return 0;
  }
  fmt::print(
      "\nequal work: provider's rows in its buffers -> decoder can evaluate the next token (Qwen3-Coder-30B-A3B "
      "shape, f16, FA on, -c {}; share backend {}; state files in {})\n{:>6} {:>10} {:>22} {:>22} {:>22} "
      "{:>22} {:>22} {:>22} {:>20} {:>6}\n",
      settings().n_ctx, decoder().backend_description(), settings().dir.string(), "tokens", "kv_bytes", "shared_ms",
      "shared_map_ms", "file_ms", "floor_ms", "shared_added_ms", "file_added_ms", "added shared/file", "rounds");
  for (const RunResult* run : measured) {
    auto c = [&](const std::string& key) { return counter(*run, key); };
    auto cell = [&](const std::string& key, int digits) {
      return fmt::format("{:.{}f} [{:.{}f}..{:.{}f}]", c(key), digits, c(key + "_p25"), digits, c(key + "_p75"),
                         digits);
    };
    const int n = tokens_of(*run);
    fmt::print("{:>6} {:>10} {:>22} {:>22} {:>22} {:>22} {:>22} {:>22} {:>20} {:>6}\n", n,
               per_token * static_cast<uint64_t>(n), cell("shared_ms", 1), cell("shared_map_ms", 1), cell("file_ms", 1),
               cell("floor_ms", 1), cell("shared_added_ms", 1), cell("file_added_ms", 1), cell("added_ratio", 3),
               c("rounds"));
    fmt::print(
        "{:>17} minor page faults (median per side): shared {:.0f}, shared_map {:.0f}, resident {:.0f}, file "
        "{:.0f}, floor {:.0f}\n",
        "", c("shared_faults"), c("shared_map_faults"), c("resident_faults"), c("file_faults"), c("floor_faults"));
  }
  // The resident provider's side (issue 24), from the same rounds.
  fmt::print(
      "\nresident provider: the region mapped and pre-faulted once ({:.1f} ms, before the rounds), per round "
      "share + receive + region check + scatter through the held mapping + adopt (same rounds as above)\n"
      "{:>6} {:>22} {:>22} {:>22} {:>22} {:>24} {:>22} {:>26} {:>14}\n",
      measured.empty() ? 0.0 : counter(*measured.front(), "resident_region_ms"), "tokens", "resident_ms", "floor_ms",
      "look_ms", "resident_added_ms", "resident_added - look", "file_added_ms", "added resident/file", "resident/file");
  for (const RunResult* run : measured) {
    auto c = [&](const std::string& key) { return counter(*run, key); };
    auto cell = [&](const std::string& key, int digits) {
      return fmt::format("{:.{}f} [{:.{}f}..{:.{}f}]", c(key), digits, c(key + "_p25"), digits, c(key + "_p75"),
                         digits);
    };
    fmt::print("{:>6} {:>22} {:>22} {:>22} {:>22} {:>24} {:>22} {:>26} {:>14.3f}\n", tokens_of(*run),
               cell("resident_ms", 1), cell("floor_ms", 1), cell("look_ms", 1), cell("resident_added_ms", 2),
               cell("resident_own_ms", 2), cell("file_added_ms", 1), cell("resident_added_ratio", 4),
               c("file_ms") > 0 ? c("resident_ms") / c("file_ms") : 0.0);
  }
  if (measured.empty()) return 0;
  const RunResult& first = *measured.front();
  const RunResult& last = *measured.back();
  const RunResult* at_4096 = nullptr;
  for (const RunResult* run : measured)
    if (tokens_of(*run) == 4096) at_4096 = run;
  fmt::print(
      "(ms, median [p25..p75] over rounds with the sides' order rotating; added = side - floor in the same "
      "round; look = the decoder's first look after the floor, in no side's floor; resident/file = ratio of the "
      "medians of the whole times)\n");
  // A ratio of two medians of which the first is at or below zero (the added cost is within
  // the noise of the floor) says nothing: the figures themselves are printed instead.
  auto growth = [&](const std::string& key, int digits) {
    const double from = counter(first, key), to = counter(last, key);
    if (from <= 0)
      return fmt::format("n/a: {:.{}f} ms at {} tokens, {:.{}f} ms at {}", from, digits, tokens_of(first), to, digits,
                         tokens_of(last));
    return fmt::format("{:.2f}x", to / from);
  };
  fmt::print(
      "targets: added shared/file <= 0.25 at 4096 (here {}), shared added flat within 1.5x from {} to {} tokens "
      "(here {})\n",
      at_4096 ? fmt::format("{:.3f}", counter(*at_4096, "added_ratio")) : std::string("not run"), tokens_of(first),
      tokens_of(last), growth("shared_added_ms", 1));
  fmt::print(
      "issue 24: resident added / file added <= 0.1 at 4096 (here {}; whole times {}), resident flat within 1.5x "
      "from {} to {} tokens (added {}; added less the look {}; whole times {}, the floor's share of it growing "
      "with the prompt)\n",
      at_4096 ? fmt::format("{:.4f}", counter(*at_4096, "resident_added_ratio")) : std::string("not run"),
      at_4096 ? fmt::format("{:.3f}", counter(*at_4096, "resident_ms") / counter(*at_4096, "file_ms"))
              : std::string("not run"),
      tokens_of(first), tokens_of(last), growth("resident_added_ms", 2), growth("resident_own_ms", 2),
      growth("resident_ms", 1));
  return 0;
}

const bool registered = add_group({
    "equal",
    "equal work per route: provider's rows in its buffers -> decoder ready (shared: scatter through the chunk fds, "
    "or the fresh mapping, or a resident provider's held mapping, + handshake + adopt; file: write + read + restore), "
    "paired",
    register_all,
    report,
    {
        {"--dir", "PATH", "where its files are written (default $TMPDIR, else /tmp)"},
        {"--rounds", "N", "paired rounds per length (default 15 to 512 tokens, 9 to 8192, 5 beyond)"},
    },
    {307, 4096, 32768},
    {16},
});

}  // namespace
}  // namespace kvshare::bench
