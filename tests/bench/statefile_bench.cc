// kvshare-bench statefile: writing and reading llama.cpp sequence-state files for the
// Qwen3-Coder-30B-A3B shape (48 layers, 4 KV heads x 128, f16, flash attention on), beside a
// memcpy of the same bytes and a plain write()/read() of them, all in one run.
// Group flags (after --): --dir PATH (default $TMPDIR or /tmp), --buffered (writer/reader
// without O_DIRECT; the default is the library's: O_DIRECT where the filesystem allows it),
// --rows f32|f16 (f16: the provider hands rows in the cache's own type, copied without
// conversion; the default f32 is what the reference and XDNA providers hand: twice the
// bytes to read).
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <vector>

#include "bench_files.h"
#include "bench_registry.h"
#include "bench_stats.h"
#include "kvshare/statefile/state_file_reader.h"
#include "kvshare/statefile/state_file_writer.h"
#include "layout/row_convert.h"
#include "layout/state_format.h"

namespace kvshare::bench {
namespace {

constexpr uint32_t kLayers = 48;
constexpr uint32_t kEmbdGqa = 4 * 128;

struct Settings {
  std::filesystem::path dir;
  bool direct = true;
  layout::GgmlType rows = layout::GgmlType::F32;
};

Settings& settings() {
  static Settings s;
  return s;
}

layout::MemoryShape qwen3_coder_shape(uint32_t n_tokens) {
  layout::MemoryShape shape;
  shape.kind = layout::MemoryKind::kv;
  shape.n_ctx = shape.n_ctx_seq = (n_tokens + 255) / 256 * 256;
  layout::KvCacheShape cache;
  cache.role = "kv";
  cache.kv_size = shape.n_ctx;
  cache.v_width = kEmbdGqa;
  for (uint32_t il = 0; il < kLayers; ++il) cache.layers.push_back({il, kEmbdGqa, kEmbdGqa, true});
  shape.kv_caches.push_back(cache);
  return shape;
}

uint64_t file_bytes(uint32_t n_tokens) {
  return layout::plan_state_layout(qwen3_coder_shape(n_tokens), n_tokens, n_tokens)->content_bytes;
}

// One layer's K (and V) as a provider computes them: f32, every token.
const std::vector<float>& provider_rows(uint32_t n_tokens) {
  static std::vector<float> rows;
  if (rows.size() != uint64_t{n_tokens} * kEmbdGqa) {
    rows.resize(uint64_t{n_tokens} * kEmbdGqa);
    std::mt19937 rng(7);
    std::normal_distribution<float> dist(0.0f, 2.0f);
    for (float& v : rows) v = dist(rng);
  }
  return rows;
}

std::filesystem::path bench_file(const char* what) {
  return settings().dir / fmt::format("kvshare-bench-statefile-{}-{}.bin", what, ::getpid());
}

void set_rate(benchmark::State& state, uint64_t bytes) {
  state.counters["gbps"] =
      benchmark::Counter(double(bytes) * double(state.iterations()) / 1e9, benchmark::Counter::kIsRate);
  state.counters["bytes"] = double(bytes);
}

Result<void> write_state_file(const std::filesystem::path& path, uint32_t n_tokens) {
  const auto& rows = provider_rows(n_tokens);
  std::vector<int32_t> tokens(n_tokens, 1);
  statefile::StateFileWriterOptions options;
  options.allow_direct = settings().direct;
  auto writer = statefile::StateFileWriter::create(path, qwen3_coder_shape(n_tokens), tokens,
                                                   static_cast<int32_t>(n_tokens), options);
  if (!writer) return fail(writer.error());
  // f16 rows reuse the first half of the f32 buffer: copied unchanged, their values do not matter.
  const statefile::RowsView view{settings().rows, rows.data(), n_tokens, 0};
  for (uint32_t il = 0; il < kLayers; ++il)
    if (auto rc = writer->write_layer(il, view, view); !rc) return rc;
  auto info = writer->commit();
  if (!info) return fail(info.error());
  return {};
}

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// The first and third quartile of `values`: how far the pairs spread around the median.
std::pair<double, double> quartiles(const std::vector<double>& values) {
  return {percentile(values, 0.25), percentile(values, 0.75)};
}

// Our writer and a plain write() of the same byte count are timed in pairs, alternating
// which goes first, and the medians and the median of the per-pair ratios are reported:
// the VM's page-cache writeback makes a single buffered write vary several-fold from one run
// to the next (docs/state-file.md, "Performance"), and pairing exposes both sides to the same
// state. Every file is removed (untimed) before the next write.
Result<double> time_plain_write(const std::filesystem::path& path, uint64_t bytes, const std::vector<char>& buffer) {
  const auto start = Clock::now();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return fail(errno, "open {}", path.string());
  uint64_t left = bytes;
  while (left > 0) {
    const ssize_t n = ::write(fd, buffer.data(), std::min<uint64_t>(left, buffer.size()));
    if (n <= 0) {
      ::close(fd);
      return fail(errno, "write {}", path.string());
    }
    left -= static_cast<uint64_t>(n);
  }
  ::close(fd);
  return seconds_since(start);
}

void bm_write_pair(benchmark::State& state) {
  const auto n_tokens = static_cast<uint32_t>(state.range(0));
  const uint64_t bytes = file_bytes(n_tokens);
  const auto ours_path = bench_file("write");
  const auto plain_path = bench_file("plain");
  const std::vector<char> buffer(std::min<uint64_t>(bytes, 64u << 20), 1);  // what a caller holding the bytes writes
  (void)provider_rows(n_tokens);
  std::vector<double> ours, plain, ratio;
  bool ours_first = true;
  for (auto _ : state) {
    double t_ours = 0, t_plain = 0;
    for (int side = 0; side < 2; ++side) {
      if ((side == 0) == ours_first) {
        const auto start = Clock::now();
        if (auto rc = write_state_file(ours_path, n_tokens); !rc) return state.SkipWithError(rc.error().what().c_str());
        t_ours = seconds_since(start);
      } else {
        auto t = time_plain_write(plain_path, bytes, buffer);
        if (!t) return state.SkipWithError(t.error().what().c_str());
        t_plain = *t;
      }
    }
    std::filesystem::remove(ours_path);
    std::filesystem::remove(plain_path);
    ours_first = !ours_first;
    state.SetIterationTime(t_ours);
    ours.push_back(t_ours);
    plain.push_back(t_plain);
    ratio.push_back(t_plain / t_ours);  // throughput ratio ours / plain
  }
  state.counters["write_gbps"] = double(bytes) / median(ours) / 1e9;
  state.counters["plain_write_gbps"] = double(bytes) / median(plain) / 1e9;
  state.counters["write_ratio"] = median(ratio);
  std::tie(state.counters["write_ratio_p25"], state.counters["write_ratio_p75"]) = quartiles(ratio);
}

// Reads of one file written by our writer: read_state_file (validates, decodes) against a
// plain read() into a fresh buffer, paired and alternated like the writes. Files below the
// reader's O_DIRECT threshold are read warm by both (a handoff file is read right after it
// was written, from the page cache); larger ones cold by both (the file's cached pages are
// dropped with POSIX_FADV_DONTNEED before each read), as the reader then uses O_DIRECT.
void drop_cached_pages(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  (void)::fdatasync(fd);
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
}

Result<double> time_plain_read(const std::filesystem::path& path, uint64_t bytes) {
  const auto start = Clock::now();
  std::unique_ptr<char[]> buffer(new char[bytes]);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return fail(errno, "open {}", path.string());
  uint64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::read(fd, buffer.get() + done, bytes - done);
    if (n <= 0) break;
    done += static_cast<uint64_t>(n);
  }
  ::close(fd);
  benchmark::DoNotOptimize(buffer.get());
  if (done != bytes) return fail(EIO, "read {}: {} of {} bytes", path.string(), done, bytes);
  return seconds_since(start);
}

void bm_read_pair(benchmark::State& state) {
  const auto n_tokens = static_cast<uint32_t>(state.range(0));
  const uint64_t bytes = file_bytes(n_tokens);
  const auto path = bench_file("read");
  if (auto rc = write_state_file(path, n_tokens); !rc) return state.SkipWithError(rc.error().what().c_str());
  const auto shape = qwen3_coder_shape(n_tokens);
  statefile::StateFileReadOptions options;
  options.allow_direct = settings().direct;
  const bool cold = options.allow_direct && bytes >= options.direct_min_bytes;
  if (!cold) (void)time_plain_read(path, bytes);  // warm the page cache once, untimed
  std::vector<double> ours, plain, ratio;
  bool ours_first = true;
  for (auto _ : state) {
    double t_ours = 0, t_plain = 0;
    for (int side = 0; side < 2; ++side) {
      if (cold) drop_cached_pages(path);
      if ((side == 0) == ours_first) {
        const auto start = Clock::now();
        auto file = statefile::read_state_file(path, &shape, options);
        if (!file) return state.SkipWithError(file.error().what().c_str());
        benchmark::DoNotOptimize(file->bytes().data());
        t_ours = seconds_since(start);
      } else {
        auto t = time_plain_read(path, bytes);
        if (!t) return state.SkipWithError(t.error().what().c_str());
        t_plain = *t;
      }
    }
    ours_first = !ours_first;
    state.SetIterationTime(t_ours);
    ours.push_back(t_ours);
    plain.push_back(t_plain);
    ratio.push_back(t_plain / t_ours);
  }
  std::filesystem::remove(path);
  state.counters["read_gbps"] = double(bytes) / median(ours) / 1e9;
  state.counters["plain_read_gbps"] = double(bytes) / median(plain) / 1e9;
  state.counters["read_ratio"] = median(ratio);
  std::tie(state.counters["read_ratio_p25"], state.counters["read_ratio_p75"]) = quartiles(ratio);
  state.counters["cold"] = cold ? 1 : 0;
}

void bm_memcpy(benchmark::State& state) {
  const uint64_t bytes = file_bytes(static_cast<uint32_t>(state.range(0)));
  const uint64_t chunk = std::min<uint64_t>(bytes, 256u << 20);
  std::vector<char> src(chunk, 1), dst(chunk);
  for (auto _ : state) {
    for (uint64_t done = 0; done < bytes; done += chunk)
      std::memcpy(dst.data(), src.data(), std::min(chunk, bytes - done));
    benchmark::ClobberMemory();
  }
  set_rate(state, bytes);
}

// f32 -> f16 conversion of every K and V element alone (what the writer converts).
void bm_convert(benchmark::State& state) {
  const auto n_tokens = static_cast<uint32_t>(state.range(0));
  const auto& rows = provider_rows(n_tokens);
  std::vector<uint16_t> out(uint64_t{n_tokens} * kEmbdGqa);
  for (auto _ : state) {
    for (uint32_t pass = 0; pass < 2 * kLayers; ++pass)
      layout::convert_row(layout::GgmlType::F32, rows.data(), layout::GgmlType::F16, out.data(),
                          static_cast<int64_t>(rows.size()));
    benchmark::ClobberMemory();
  }
  set_rate(state, file_bytes(n_tokens));
}

int iterations_for(int tokens, bool smoke) {
  if (smoke) return 1;
  if (tokens <= 512) return 21;
  if (tokens <= 8192) return 7;
  return 3;
}

void register_all(const BenchArgs& args) {
  Settings& s = settings();
  s.dir = scratch_dir(args);
  for (size_t i = 0; i < args.rest.size(); ++i) {
    if (args.rest[i] == "--buffered") s.direct = false;
    if (args.rest[i] == "--rows" && i + 1 < args.rest.size())  // f32|f16, checked by kvshare-bench
      s.rows = args.rest[i + 1] == "f16" ? layout::GgmlType::F16 : layout::GgmlType::F32;
  }
  const std::vector<int>& tokens = args.tokens;
  for (int n : tokens) {
    const int iters = iterations_for(n, args.smoke);
    using Fn = void (*)(benchmark::State&);
    const std::pair<const char*, Fn> cases[] = {
        {"memcpy", bm_memcpy}, {"convert", bm_convert}, {"write_pair", bm_write_pair}, {"read_pair", bm_read_pair}};
    for (const auto& [name, fn] : cases) {
      auto* bench = benchmark::RegisterBenchmark(fmt::format("statefile/{}/{}", name, n).c_str(), fn)
                        ->Arg(n)
                        ->Iterations(iters)
                        ->Unit(benchmark::kMillisecond);
      // The pairs time our side themselves (the plain side is a counter beside it).
      if (fn == bm_write_pair || fn == bm_read_pair)
        bench->UseManualTime();
      else
        bench->UseRealTime();
    }
  }
}

double counter_of(const std::vector<RunResult>& runs, const std::string& name, const char* counter) {
  for (const auto& run : runs)
    if (run.name.rfind(name, 0) == 0 && run.counters.count(counter)) return run.counters.at(counter);
  return 0;
}

int report(const std::vector<RunResult>& runs, const BenchArgs& args) {
  std::vector<int> tokens;
  for (const RunResult* run : runs_with_prefix(runs, "statefile/memcpy/"))
    tokens.push_back(std::stoi(run->name.substr(std::string("statefile/memcpy/").size())));
  if (!args.json)
    fmt::print(
        "\nstatefile ({} layers x {} K/V elements, f16, FA on; dir {}, O_DIRECT {} (files >= 1 GiB); "
        "provider rows {}, f32->f16 via {})\n{:>7} {:>12} {:>9} {:>11} {:>20} {:>10} {:>9} {:>20} {:>5} {:>9} {:>9}\n",
        kLayers, kEmbdGqa, settings().dir.string(), settings().direct ? "on" : "off",
        settings().rows == layout::GgmlType::F16 ? "f16" : "f32", layout::convert_backend_name(), "tokens", "bytes",
        "write", "plain_wr", "ratio [p25..p75]", "read", "plain_rd", "ratio [p25..p75]", "cold", "memcpy", "convert");
  for (int n : tokens) {
    const uint64_t bytes = file_bytes(static_cast<uint32_t>(n));
    auto g = [&](const char* what, const char* counter) {
      return counter_of(runs, fmt::format("statefile/{}/{}/", what, n), counter);
    };
    const double w = g("write_pair", "write_gbps"), pw = g("write_pair", "plain_write_gbps"),
                 wr = g("write_pair", "write_ratio"), r = g("read_pair", "read_gbps"),
                 pr = g("read_pair", "plain_read_gbps"), rr = g("read_pair", "read_ratio"), m = g("memcpy", "gbps"),
                 c = g("convert", "gbps");
    const double wr25 = g("write_pair", "write_ratio_p25"), wr75 = g("write_pair", "write_ratio_p75"),
                 rr25 = g("read_pair", "read_ratio_p25"), rr75 = g("read_pair", "read_ratio_p75");
    const bool cold = g("read_pair", "cold") > 0;
    if (args.json)
      fmt::print(
          "{{\"bench\":\"statefile\",\"tokens\":{},\"bytes\":{},\"write_gbps\":{:.3f},\"read_gbps\":{:.3f},"
          "\"plain_write_gbps\":{:.3f},\"plain_read_gbps\":{:.3f},\"memcpy_gbps\":{:.3f},"
          "\"convert_gbps\":{:.3f},\"write_ratio\":{:.3f},\"write_ratio_p25\":{:.3f},\"write_ratio_p75\":{:.3f},"
          "\"read_ratio\":{:.3f},\"read_ratio_p25\":{:.3f},\"read_ratio_p75\":{:.3f},\"read_cold\":{},"
          "\"direct\":{},\"rows\":\"{}\"}}\n",
          n, bytes, w, r, pw, pr, m, c, wr, wr25, wr75, rr, rr25, rr75, cold ? "true" : "false",
          settings().direct ? "true" : "false", settings().rows == layout::GgmlType::F16 ? "f16" : "f32");
    else
      fmt::print("{:>7} {:>12} {:>9.2f} {:>11.2f} {:>20} {:>10.2f} {:>9.2f} {:>20} {:>5} {:>9.2f} {:>9.2f}\n", n, bytes,
                 w, pw, fmt::format("{:.2f} [{:.2f}..{:.2f}]", wr, wr25, wr75), r, pr,
                 fmt::format("{:.2f} [{:.2f}..{:.2f}]", rr, rr25, rr75), cold ? "yes" : "no", m, c);
  }
  if (!args.json)
    fmt::print(
        "(GB/s, medians of paired runs; ratio = ours / plain, median and quartiles over the pairs; "
        "target >= 0.8)\n");
  return 0;
}

const bool registered = add_group({
    "statefile",
    "sequence-state file write/read vs plain write()/read() and memcpy (Qwen3-Coder-30B-A3B shape)",
    register_all,
    report,
    {
        {"--dir", "PATH", "where its files are written (default $TMPDIR, else /tmp)"},
        {"--buffered", "", "no O_DIRECT for the writer and the reader"},
        {"--rows", "f32|f16", "the provider's rows: f32 (default, converted) or already f16 (copied)"},
    },
    {307, 4096, 32768},
    {16},
});

}  // namespace
}  // namespace kvshare::bench
