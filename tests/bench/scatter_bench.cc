// kvshare-bench scatter: xdna::scatter throughput for the Qwen3-Coder-30B-A3B cache shape
// (48 layers, 4 KV heads x 128, f16 cache, flash attention) beside memcpy of the same
// destination bytes, measured in the same run on the same number of threads.
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <sys/mman.h>

#include <cstring>
#include <thread>
#include <vector>

#include "bench_registry.h"
#include "layout/half.h"
#include "layout/row_convert.h"
#include "tests/xdna/cache_fixture.h"
#include "xdna/scatter.h"

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
        memory(xdna::testing::make_memory(spec)),
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
      batch.layers.push_back({il, rows.data + static_cast<size_t>(il) * row_bytes * shape.n_tokens, shape.n_embd,
                              shape.n_embd});
  }
  xdna::ScatterTarget target() const {
    std::vector<std::span<std::byte>> spans;
    for (const auto& chunk : chunks) spans.emplace_back(chunk->data, chunk->size);
    return xdna::ScatterTarget{layout, memory, std::move(spans), 0, 128, 128};
  }
  uint64_t destination_bytes() const { return layout::kv_bytes_per_token(memory) * batch.n_tokens; }

  xdna::testing::CacheSpec spec;
  layout::MemoryShape memory;
  layout::ShareLayout layout;
  uint64_t row_bytes;
  PageBuffer rows;
  std::vector<std::unique_ptr<PageBuffer>> chunks;
  xdna::ScatterBatch batch;
};

void set_rate(benchmark::State& state, uint64_t bytes) {
  state.counters["gbps"] = benchmark::Counter(static_cast<double>(bytes) * static_cast<double>(state.iterations()) / 1e9,
                                              benchmark::Counter::kIsRate);
}

void bm_scatter(benchmark::State& state, GgmlType src_type, Shape shape) {
  Setup setup(shape, src_type);
  const xdna::ScatterTarget target = setup.target();
  for (auto _ : state) {
    auto result = xdna::scatter(target, setup.batch);
    if (!result) {
      state.SkipWithError(result.error().what().c_str());
      return;
    }
    benchmark::ClobberMemory();
  }
  set_rate(state, setup.destination_bytes());
}

// memcpy of the destination's byte count, split over the same threads the scatter uses.
void bm_memcpy(benchmark::State& state, Shape shape) {
  Setup setup(shape, GgmlType::F16);
  const uint64_t bytes = setup.destination_bytes();
  PageBuffer source(bytes), destination(bytes);
  const unsigned n_threads = bench_threads();
  for (auto _ : state) {
    std::vector<std::jthread> helpers;
    const uint64_t part = bytes / n_threads;
    for (unsigned i = 1; i < n_threads; ++i)
      helpers.emplace_back([&, i] {
        const uint64_t end = i + 1 == n_threads ? bytes : (i + 1) * part;
        std::memcpy(destination.data + i * part, source.data + i * part, end - i * part);
      });
    std::memcpy(destination.data, source.data, part);
    helpers.clear();
    benchmark::ClobberMemory();
  }
  set_rate(state, bytes);
}

const char* kCases[] = {"f16->f16", "f32->f16"};

const bool registered = add_group({
    "scatter",
    "xdna::scatter f16->f16 and f32->f16 into a Qwen3-Coder-30B-A3B f16 cache vs memcpy of the same bytes",
    [](const BenchArgs& args) {
      std::vector<int> tokens = args.tokens.empty() ? std::vector<int>{4096} : args.tokens;
      for (int n : tokens) {
        const Shape shape = shape_for(args, n);
        const auto label = std::to_string(shape.n_tokens);
        auto* memcpy_case = benchmark::RegisterBenchmark(("scatter/memcpy/" + label).c_str(),
                                                         [shape](benchmark::State& s) { bm_memcpy(s, shape); });
        auto* f16 = benchmark::RegisterBenchmark(("scatter/f16->f16/" + label).c_str(), [shape](benchmark::State& s) {
          bm_scatter(s, GgmlType::F16, shape);
        });
        auto* f32 = benchmark::RegisterBenchmark(("scatter/f32->f16/" + label).c_str(), [shape](benchmark::State& s) {
          bm_scatter(s, GgmlType::F32, shape);
        });
        for (auto* b : {memcpy_case, f16, f32}) {
          b->Unit(benchmark::kMillisecond)->UseRealTime();
          if (args.smoke) b->Iterations(1);
          else b->Repetitions(3)->Iterations(4);
        }
      }
    },
    [](const std::vector<RunResult>& runs, const BenchArgs& args) {
      // Runs are named "scatter/<case>/<tokens>/<benchmark options>": match up to the tokens.
      auto median_gbps = [&](const std::string& prefix) {
        std::vector<double> values;
        for (const RunResult* run : runs_with_prefix(runs, prefix + "/"))
          if (run->counters.count("gbps")) values.push_back(run->counters.at("gbps"));
        if (values.empty()) return 0.0;
        std::sort(values.begin(), values.end());
        return values[values.size() / 2];
      };
      std::vector<std::string> labels;
      for (const RunResult* run : runs_with_prefix(runs, "scatter/memcpy/")) {
        std::string label = run->name.substr(std::strlen("scatter/memcpy/"));
        label = label.substr(0, label.find('/'));
        if (std::find(labels.begin(), labels.end(), label) == labels.end()) labels.push_back(label);
      }
      for (const std::string& label : labels) {
        const double memcpy_gbps = median_gbps("scatter/memcpy/" + label);
        for (const char* name : kCases) {
          const double gbps = median_gbps(std::string("scatter/") + name + "/" + label);
          const double ratio = memcpy_gbps > 0 ? gbps / memcpy_gbps : 0;
          if (args.json)
            fmt::print("{{\"bench\":\"scatter\",\"case\":\"{}\",\"tokens\":{},\"threads\":{},\"backend\":\"{}\","
                       "\"gbps\":{:.3f},\"memcpy_gbps\":{:.3f},\"ratio\":{:.3f}}}\n",
                       name, label, bench_threads(), layout::convert_backend_name(), gbps, memcpy_gbps, ratio);
          else
            fmt::print("scatter {} at {} tokens ({} threads, {}): {:.2f} GB/s, memcpy {:.2f} GB/s, ratio {:.3f}\n",
                       name, label, bench_threads(), layout::convert_backend_name(), gbps, memcpy_gbps, ratio);
        }
      }
      return 0;
    },
});

}  // namespace
}  // namespace kvshare::bench
