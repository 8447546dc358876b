// kvshare-bench statefile: writing and reading llama.cpp sequence-state files for the
// Qwen3-Coder-30B-A3B shape (48 layers, 4 KV heads x 128, f16, flash attention on), beside a
// memcpy of the same bytes and a plain write()/read() of them, all in one run.
// Group flags (after --): --dir PATH (default $TMPDIR or /tmp), --buffered (writer/reader
// without O_DIRECT; the default is the library's: O_DIRECT where the filesystem allows it).
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <vector>

#include "bench_registry.h"
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
  state.counters["gbps"] = benchmark::Counter(double(bytes) * double(state.iterations()) / 1e9,
                                              benchmark::Counter::kIsRate);
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
  const statefile::RowsView view{layout::GgmlType::F32, rows.data(), n_tokens, 0};
  for (uint32_t il = 0; il < kLayers; ++il)
    if (auto rc = writer->write_layer(il, view, view); !rc) return rc;
  auto info = writer->commit();
  if (!info) return fail(info.error());
  return {};
}

void bm_write(benchmark::State& state) {
  const auto n_tokens = static_cast<uint32_t>(state.range(0));
  const auto path = bench_file("write");
  (void)provider_rows(n_tokens);
  for (auto _ : state) {
    if (auto rc = write_state_file(path, n_tokens); !rc) {
      state.SkipWithError(rc.error().what().c_str());
      return;
    }
    state.PauseTiming();
    std::filesystem::remove(path);
    state.ResumeTiming();
  }
  set_rate(state, file_bytes(n_tokens));
}

// write() of the same number of bytes from a buffer, to a fresh file, closed: what a caller
// with the finished bytes in memory pays.
void bm_plain_write(benchmark::State& state) {
  const uint64_t bytes = file_bytes(static_cast<uint32_t>(state.range(0)));
  const auto path = bench_file("plain");
  std::vector<char> buffer(std::min<uint64_t>(bytes, 64u << 20), 1);
  for (auto _ : state) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    uint64_t left = bytes;
    while (left > 0) {
      const ssize_t n = ::write(fd, buffer.data(), std::min<uint64_t>(left, buffer.size()));
      if (n <= 0) {
        state.SkipWithError("write failed");
        break;
      }
      left -= static_cast<uint64_t>(n);
    }
    ::close(fd);
    state.PauseTiming();
    std::filesystem::remove(path);
    state.ResumeTiming();
  }
  set_rate(state, bytes);
}

void bm_read(benchmark::State& state) {
  const auto n_tokens = static_cast<uint32_t>(state.range(0));
  const auto path = bench_file("read");
  if (auto rc = write_state_file(path, n_tokens); !rc) {
    state.SkipWithError(rc.error().what().c_str());
    return;
  }
  const auto shape = qwen3_coder_shape(n_tokens);
  statefile::StateFileReadOptions options;
  options.allow_direct = settings().direct;
  for (auto _ : state) {
    auto file = statefile::read_state_file(path, &shape, options);
    if (!file) {
      state.SkipWithError(file.error().what().c_str());
      break;
    }
    benchmark::DoNotOptimize(file->bytes().data());
  }
  std::filesystem::remove(path);
  set_rate(state, file_bytes(n_tokens));
}

// read() of the same file into a fresh buffer of its size.
void bm_plain_read(benchmark::State& state) {
  const auto n_tokens = static_cast<uint32_t>(state.range(0));
  const auto path = bench_file("plainread");
  if (auto rc = write_state_file(path, n_tokens); !rc) {
    state.SkipWithError(rc.error().what().c_str());
    return;
  }
  const uint64_t bytes = file_bytes(n_tokens);
  for (auto _ : state) {
    std::unique_ptr<char[]> buffer(new char[bytes]);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    uint64_t done = 0;
    while (done < bytes) {
      const ssize_t n = ::read(fd, buffer.get() + done, bytes - done);
      if (n <= 0) break;
      done += static_cast<uint64_t>(n);
    }
    ::close(fd);
    benchmark::DoNotOptimize(buffer.get());
  }
  std::filesystem::remove(path);
  set_rate(state, bytes);
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
  if (tokens <= 512) return 20;
  if (tokens <= 8192) return 3;
  return 1;
}

void register_all(const BenchArgs& args) {
  Settings& s = settings();
  const char* tmp = std::getenv("TMPDIR");
  s.dir = tmp && *tmp ? tmp : "/tmp";
  for (size_t i = 0; i < args.rest.size(); ++i) {
    if (args.rest[i] == "--dir" && i + 1 < args.rest.size()) s.dir = args.rest[++i];
    if (args.rest[i] == "--buffered") s.direct = false;
  }
  std::vector<int> tokens = args.tokens;
  if (tokens.empty()) tokens = args.smoke ? std::vector<int>{16} : std::vector<int>{307, 4096, 32768};
  for (int n : tokens) {
    const int iters = iterations_for(n, args.smoke);
    using Fn = void (*)(benchmark::State&);
    const std::pair<const char*, Fn> cases[] = {{"memcpy", bm_memcpy},         {"convert", bm_convert},
                                                {"plain_write", bm_plain_write}, {"write", bm_write},
                                                {"plain_read", bm_plain_read},   {"read", bm_read}};
    for (const auto& [name, fn] : cases)
      benchmark::RegisterBenchmark(fmt::format("statefile/{}/{}", name, n).c_str(), fn)
          ->Arg(n)
          ->Iterations(iters)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
  }
}

double gbps_of(const std::vector<RunResult>& runs, const std::string& name) {
  for (const auto& run : runs)
    if (run.name.rfind(name, 0) == 0 && run.counters.count("gbps")) return run.counters.at("gbps");
  return 0;
}

int report(const std::vector<RunResult>& runs, const BenchArgs& args) {
  std::vector<int> tokens;
  for (const RunResult* run : runs_with_prefix(runs, "statefile/memcpy/"))
    tokens.push_back(std::stoi(run->name.substr(std::string("statefile/memcpy/").size())));
  if (!args.json)
    fmt::print("\nstatefile ({} layers x {} K/V elements, f16, FA on; dir {}, O_DIRECT {}; f32->f16 via {})\n"
               "{:>7} {:>12} {:>9} {:>11} {:>9} {:>10} {:>9} {:>9} {:>9} {:>9}\n",
               kLayers, kEmbdGqa, settings().dir.string(), settings().direct ? "on" : "off",
               layout::convert_backend_name(), "tokens", "bytes", "write", "plain_wr", "ratio", "read", "plain_rd",
               "ratio", "memcpy", "convert");
  for (int n : tokens) {
    const uint64_t bytes = file_bytes(static_cast<uint32_t>(n));
    auto g = [&](const char* what) { return gbps_of(runs, fmt::format("statefile/{}/{}/", what, n)); };
    const double w = g("write"), pw = g("plain_write"), r = g("read"), pr = g("plain_read"), m = g("memcpy"),
                 c = g("convert");
    if (args.json)
      fmt::print("{{\"bench\":\"statefile\",\"tokens\":{},\"bytes\":{},\"write_gbps\":{:.3f},\"read_gbps\":{:.3f},"
                 "\"plain_write_gbps\":{:.3f},\"plain_read_gbps\":{:.3f},\"memcpy_gbps\":{:.3f},"
                 "\"convert_gbps\":{:.3f},\"write_ratio\":{:.3f},\"read_ratio\":{:.3f},\"direct\":{}}}\n",
                 n, bytes, w, r, pw, pr, m, c, pw > 0 ? w / pw : 0, pr > 0 ? r / pr : 0,
                 settings().direct ? "true" : "false");
    else
      fmt::print("{:>7} {:>12} {:>9.2f} {:>11.2f} {:>9.2f} {:>10.2f} {:>9.2f} {:>9.2f} {:>9.2f} {:>9.2f}\n", n, bytes,
                 w, pw, pw > 0 ? w / pw : 0, r, pr, pr > 0 ? r / pr : 0, m, c);
  }
  if (!args.json) fmt::print("(GB/s; ratio = ours / plain; target >= 0.8)\n");
  return 0;
}

const bool registered = add_group({
    "statefile",
    "sequence-state file write/read vs plain write()/read() and memcpy (Qwen3-Coder-30B-A3B shape)",
    register_all,
    report,
});

}  // namespace
}  // namespace kvshare::bench
