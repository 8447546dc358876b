// kvshare-bench scatter: kvshare::scatter throughput for the Qwen3-Coder-30B-A3B cache shape
// (48 layers, 4 KV heads x 128, f16 cache, flash attention) beside memcpy of the same
// destination bytes, measured in the same run on the same number of threads.
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "bench_registry.h"
#include "bench_stats.h"
#include "kvshare/scatter/scatter.h"
#include "layout/half.h"
#include "layout/row_convert.h"
#include "tests/support/cache_fixture.h"

namespace kvshare::bench {
namespace {

using layout::GgmlType;

// Anonymous memory, page-aligned like the real region's mappings, touched up front so
// page faults stay out of the timing.
struct PageBuffer {
  explicit PageBuffer(size_t bytes) : size(bytes) {
    data = static_cast<std::byte*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (data == MAP_FAILED) throw std::bad_alloc();
    std::memset(data, 0, bytes);
  }
  ~PageBuffer() { munmap(data, size); }
  PageBuffer(const PageBuffer&) = delete;
  PageBuffer& operator=(const PageBuffer&) = delete;
  std::byte* data;
  size_t size;
};

struct Shape {
  uint32_t n_layer;
  uint32_t n_embd;  // n_embd_k_gqa == n_embd_v_gqa
  uint32_t n_tokens;
};

Shape shape_for(const BenchArgs& args, int tokens) {
  if (args.smoke) return {2, 512, 64};
  return {48, 4 * 128, static_cast<uint32_t>(tokens)};
}

unsigned bench_threads() { return std::max(1u, std::thread::hardware_concurrency()); }

// One f16 cache of the shape, mapped like a region, with every layer's provider rows.
struct Setup {
  Setup(const Shape& shape, GgmlType src_type)
      : spec{std::vector<uint32_t>(shape.n_layer, shape.n_embd), std::vector<uint32_t>(shape.n_layer, shape.n_embd),
             shape.n_tokens},
        memory(kvshare::testing::make_memory(spec)),
        layout(layout::share_layout(memory)),
        row_bytes(layout::ggml_row_size(src_type, 2 * shape.n_embd)),
        rows(static_cast<size_t>(row_bytes) * shape.n_tokens * shape.n_layer) {
    for (const auto& chunk : layout.chunks) chunks.push_back(std::make_unique<PageBuffer>(chunk.size_bytes));
    // Ordinary activations (every f32 -> f16 lane takes the normal path), generated for
    // one layer and copied to the others.
    const size_t layer_bytes = static_cast<size_t>(row_bytes) * shape.n_tokens;
    const size_t element_bytes = layout::ggml_row_size(src_type, 1);
    for (size_t i = 0; i < layer_bytes / element_bytes; ++i) {
      const float value = static_cast<float>((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
      if (src_type == GgmlType::F16) {
        const uint16_t h = layout::fp32_to_fp16(value);
        std::memcpy(rows.data + i * 2, &h, 2);
      } else {
        std::memcpy(rows.data + i * 4, &value, 4);
      }
    }
    for (uint32_t il = 1; il < shape.n_layer; ++il) std::memcpy(rows.data + il * layer_bytes, rows.data, layer_bytes);
    batch.src_type = src_type;
    batch.pos0 = 0;
    batch.n_tokens = shape.n_tokens;
    batch.row_stride = row_bytes;
    batch.n_threads = bench_threads();
    for (uint32_t il = 0; il < shape.n_layer; ++il)
      batch.layers.push_back(
          {il, rows.data + static_cast<size_t>(il) * row_bytes * shape.n_tokens, shape.n_embd, shape.n_embd});
  }
  kvshare::ScatterTarget target() const {
    std::vector<std::span<std::byte>> spans;
    for (const auto& chunk : chunks) spans.emplace_back(chunk->data, chunk->size);
    return kvshare::ScatterTarget{layout, memory, std::move(spans), 0, 128, 128};
  }
  uint64_t destination_bytes() const { return layout::kv_bytes_per_token(memory) * batch.n_tokens; }

  kvshare::testing::CacheSpec spec;
  layout::MemoryShape memory;
  layout::ShareLayout layout;
  uint64_t row_bytes;
  PageBuffer rows;
  std::vector<std::unique_ptr<PageBuffer>> chunks;
  kvshare::ScatterBatch batch;
};

using Clock = std::chrono::steady_clock;

// memcpy of `bytes`, split over the same threads the scatter uses.
void threaded_memcpy(std::byte* destination, const std::byte* source, uint64_t bytes, unsigned n_threads) {
  std::vector<std::jthread> helpers;
  const uint64_t part = bytes / n_threads;
  for (unsigned i = 1; i < n_threads; ++i)
    helpers.emplace_back([=] {
      const uint64_t end = i + 1 == n_threads ? bytes : (i + 1) * part;
      std::memcpy(destination + i * part, source + i * part, end - i * part);
    });
  std::memcpy(destination, source, part);
}

const char* kCases[] = {"f16->f16", "f32->f16"};

// One round: memcpy of the destination's bytes, the f16 scatter and the f32 scatter, in an
// order that rotates from round to round, so that a busy moment of the machine lands on
// each alike; the ratio of each round (scatter GB/s over the same round's memcpy GB/s) is
// what the report's median and quartiles are of. Page faults stay out: every buffer is
// touched before the first round.
void bm_rounds(benchmark::State& state, Shape shape) {
  Setup f16(shape, GgmlType::F16), f32(shape, GgmlType::F32);
  const kvshare::ScatterTarget f16_target = f16.target(), f32_target = f32.target();
  const uint64_t bytes = f16.destination_bytes();
  PageBuffer source(bytes), destination(bytes);
  const unsigned n_threads = bench_threads();
  std::vector<double> memcpy_gbps, gbps[2], ratio[2];
  // One untimed round first: the threads' stacks, the rows in cache, the CPU's clock.
  threaded_memcpy(destination.data, source.data, bytes, n_threads);
  for (const auto* target : {&f16_target, &f32_target})
    if (auto result = kvshare::scatter(*target, target == &f16_target ? f16.batch : f32.batch); !result)
      return state.SkipWithError(result.error().what().c_str());
  size_t turn = 0;
  for (auto _ : state) {
    double seconds[3] = {0, 0, 0};  // memcpy, f16->f16, f32->f16
    for (size_t k = 0; k < 3; ++k) {
      const size_t which = (turn + k) % 3;
      const auto start = Clock::now();
      if (which == 0) {
        threaded_memcpy(destination.data, source.data, bytes, n_threads);
      } else {
        auto result = kvshare::scatter(which == 1 ? f16_target : f32_target, which == 1 ? f16.batch : f32.batch);
        if (!result) return state.SkipWithError(result.error().what().c_str());
      }
      benchmark::ClobberMemory();
      seconds[which] = std::chrono::duration<double>(Clock::now() - start).count();
    }
    ++turn;
    state.SetIterationTime(seconds[2]);
    memcpy_gbps.push_back(static_cast<double>(bytes) / seconds[0] / 1e9);
    for (int c = 0; c < 2; ++c) {
      gbps[c].push_back(static_cast<double>(bytes) / seconds[c + 1] / 1e9);
      ratio[c].push_back(seconds[0] / seconds[c + 1]);
    }
  }
  record_spread(state, "memcpy_gbps", memcpy_gbps);
  for (int c = 0; c < 2; ++c) {
    record_spread(state, std::string(kCases[c]) + "_gbps", gbps[c]);
    record_spread(state, std::string(kCases[c]) + "_ratio", ratio[c]);
  }
  state.counters["tokens"] = shape.n_tokens;
  state.counters["rounds"] = static_cast<double>(state.iterations());
}

const bool registered = add_group({
    "scatter",
    "kvshare::scatter f16->f16 and f32->f16 into a Qwen3-Coder-30B-A3B f16 cache vs memcpy of the same bytes, "
    "in rotating rounds",
    [](const BenchArgs& args) {
      for (int n : args.tokens) {
        const Shape shape = shape_for(args, n);
        benchmark::RegisterBenchmark(("scatter/" + std::to_string(shape.n_tokens)).c_str(),
                                     [shape](benchmark::State& s) { bm_rounds(s, shape); })
            ->Unit(benchmark::kMillisecond)
            ->UseManualTime()
            ->Iterations(args.smoke ? 1 : 15);
      }
    },
    [](const std::vector<RunResult>& runs, const BenchArgs& args) {
      for (const RunResult* run : runs_with_prefix(runs, "scatter/")) {
        auto c = [&](const std::string& key) { return run->counters.count(key) ? run->counters.at(key) : 0.0; };
        if (c("tokens") == 0) continue;
        for (const char* name : kCases) {
          const std::string p = name;
          if (args.json)
            fmt::print(
                "{{\"bench\":\"scatter\",\"case\":\"{}\",\"tokens\":{},\"threads\":{},\"backend\":\"{}\","
                "\"rounds\":{},\"gbps\":{:.3f},\"gbps_p25\":{:.3f},\"gbps_p75\":{:.3f},\"memcpy_gbps\":{:.3f},"
                "\"memcpy_gbps_p25\":{:.3f},\"memcpy_gbps_p75\":{:.3f},\"ratio\":{:.3f},\"ratio_p25\":{:.3f},"
                "\"ratio_p75\":{:.3f}}}\n",
                name, c("tokens"), bench_threads(), layout::convert_backend_name(), c("rounds"), c(p + "_gbps"),
                c(p + "_gbps_p25"), c(p + "_gbps_p75"), c("memcpy_gbps"), c("memcpy_gbps_p25"), c("memcpy_gbps_p75"),
                c(p + "_ratio"), c(p + "_ratio_p25"), c(p + "_ratio_p75"));
          else
            fmt::print(
                "scatter {} at {} tokens ({} threads, {}): {:.2f} GB/s, memcpy {:.2f} GB/s, ratio {:.3f} "
                "[{:.3f}..{:.3f}] over {} rounds (target >= 0.7 for f32->f16)\n",
                name, c("tokens"), bench_threads(), layout::convert_backend_name(), c(p + "_gbps"), c("memcpy_gbps"),
                c(p + "_ratio"), c(p + "_ratio_p25"), c(p + "_ratio_p75"), c("rounds"));
        }
      }
      return 0;
    },
    {},
    {4096},
});

}  // namespace
}  // namespace kvshare::bench
