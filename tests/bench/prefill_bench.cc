// kvshare-bench prefill: the reference provider's prefill rate on a generated qwen3-shaped
// model of ~100M parameters (16 layers, embd 768, 12 heads, 4 KV heads, ff 2048, f16
// weights) and its cost split: the forward pass alone, forward + scatter into a region
// (the shared route), forward + state-file write (the file route), side by side.
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <stdexcept>
#include <vector>

#include "bench_registry.h"
#include "kvshare/scatter/scatter.h"
#include "kvshare/statefile/state_file_writer.h"
#include "layout/share_layout.h"
#include "refmodel/engine.h"
#include "refmodel/model_generator.h"
#include "refmodel/model_impl.h"

namespace kvshare::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct Setup {
  std::shared_ptr<const refmodel::Model> model;
  std::string description;
};

Setup& setup(bool smoke) {
  static std::unique_ptr<Setup> s;
  if (s) return *s;
  refmodel::GeneratorOptions o;
  if (!smoke) {
    o.n_layer = 16;
    o.n_embd = 768;
    o.n_head = 12;
    o.n_head_kv = 4;
    o.head_dim = 64;
    o.n_ff = 2048;
    o.wtype = layout::GgmlType::F16;
  }
  auto bytes = refmodel::generate_model_bytes(o);
  if (!bytes) throw std::runtime_error(bytes.error().what());
  auto owned = std::make_shared<std::vector<std::byte>>(std::move(*bytes));
  auto model = refmodel::Model::from_gguf(*owned, owned, "bench");
  if (!model) throw std::runtime_error(model.error().what());
  uint64_t params = 0;
  for (const auto& t : (*model)->tensor_infos()) params += static_cast<uint64_t>(t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3]);
  s = std::make_unique<Setup>(
      Setup{*model, fmt::format("{} layers, embd {}, {:.1f}M parameters, {} weights", (*model)->shape().n_layer,
                                o.n_embd, params / 1e6, layout::ggml_type_name(o.wtype))});
  return *s;
}

struct Buffers {
  std::vector<std::vector<std::byte>> storage;
  refmodel::KvMemory kv;
};

std::unique_ptr<Buffers> buffers(const refmodel::Model& model, uint32_t n_ctx) {
  layout::KvParams p;
  p.n_ctx = n_ctx;
  auto memory = layout::derive_memory_shape(model.shape(), p);
  if (!memory) throw std::runtime_error(memory.error().what());
  auto b = std::make_unique<Buffers>();
  b->kv.memory = *memory;
  b->kv.layout = layout::share_layout(*memory);
  for (const auto& c : b->kv.layout.chunks) b->storage.emplace_back(c.size_bytes);
  for (auto& s : b->storage) b->kv.chunks.emplace_back(s);
  return b;
}

enum class Sink { none, scatter, state_file };

void bm_prefill(benchmark::State& state, Sink sink_kind, bool smoke) {
  Setup& s = setup(smoke);
  const auto n = static_cast<uint32_t>(state.range(0));
  const uint32_t n_ctx = std::max<uint32_t>(256, (n + 255) / 256 * 256);
  auto own = buffers(*s.model, n_ctx);
  auto region = buffers(*s.model, n_ctx);
  auto ctx = refmodel::Context::create(s.model, own->kv, 0);
  if (!ctx) {
    state.SkipWithError(ctx.error().what().c_str());
    return;
  }
  const auto& hp = static_cast<const refmodel::LoadedModel&>(*s.model).hparams();
  std::vector<int32_t> tokens(n);
  for (uint32_t i = 0; i < n; ++i) tokens[i] = static_cast<int32_t>((i * 37 + 5) % hp.n_vocab);
  const auto dir = std::filesystem::temp_directory_path() / fmt::format("kvshare-bench-prefill-{}", ::getpid());
  std::filesystem::create_directories(dir);
  double write_s = 0;
  for (auto _ : state) {
    std::optional<statefile::StateFileWriter> writer;
    if (sink_kind == Sink::state_file) {
      statefile::StateFileWriterOptions wo;
      wo.n_embd_head_k = hp.n_embd_head_k;
      wo.n_embd_head_v = hp.n_embd_head_v;
      auto w =
          statefile::StateFileWriter::create(dir / "slot.bin", region->kv.memory, tokens, static_cast<int32_t>(n), wo);
      if (!w) {
        state.SkipWithError(w.error().what().c_str());
        break;
      }
      writer.emplace(std::move(*w));
    }
    kvshare::ScatterTarget target{region->kv.layout, region->kv.memory, region->kv.chunks, 0,
                                  hp.n_embd_head_k,  hp.n_embd_head_v};
    auto ok = (*ctx)->prefill(tokens, [&](const refmodel::LayerRows& rows) -> Result<void> {
      if (sink_kind == Sink::none) return {};
      const auto t0 = Clock::now();
      const uint64_t stride = (rows.n_embd_k_gqa + rows.n_embd_v_gqa) * sizeof(float);
      Result<void> r;
      if (sink_kind == Sink::scatter) {
        kvshare::ScatterBatch batch;
        batch.layers.push_back({rows.il, rows.rows.data(), rows.n_embd_k_gqa, rows.n_embd_v_gqa});
        batch.pos0 = static_cast<uint32_t>(rows.pos0);
        batch.n_tokens = rows.n_tokens;
        batch.row_stride = stride;
        r = kvshare::scatter(target, batch);
      } else {
        r = writer->write_layer(rows.il, {layout::GgmlType::F32, rows.rows.data(), rows.n_tokens, stride},
                                {layout::GgmlType::F32, rows.rows.data() + rows.n_embd_k_gqa, rows.n_tokens, stride});
      }
      write_s += std::chrono::duration<double>(Clock::now() - t0).count();
      return r;
    });
    if (ok && writer) {
      const auto t0 = Clock::now();
      auto c = writer->commit();
      write_s += std::chrono::duration<double>(Clock::now() - t0).count();
      if (!c) ok = fail(c.error());
    }
    if (!ok) {
      state.SkipWithError(ok.error().what().c_str());
      break;
    }
  }
  std::filesystem::remove_all(dir);
  state.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(n) * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["write_ms"] = state.iterations() ? write_s * 1e3 / static_cast<double>(state.iterations()) : 0.0;
}

const bool registered = add_group({
    "prefill",
    "reference provider prefill tokens/s on a ~100M-parameter qwen3-shaped model: forward pass, + scatter, + state "
    "file",
    [](const BenchArgs& args) {
      const bool smoke = args.smoke;
      for (int n : args.tokens) {
        for (auto [name, kind] : {std::pair{"forward", Sink::none}, std::pair{"scatter", Sink::scatter},
                                  std::pair{"statefile", Sink::state_file}}) {
          auto* b =
              benchmark::RegisterBenchmark(fmt::format("prefill/{}/{}", name, n).c_str(),
                                           [sink = kind, smoke](benchmark::State& st) { bm_prefill(st, sink, smoke); });
          b->Arg(n)->Unit(benchmark::kMillisecond)->UseRealTime();
          if (smoke)
            b->Iterations(1);
          else
            b->MinTime(2.0);
        }
      }
    },
    [](const std::vector<RunResult>& runs, const BenchArgs& args) {
      if (!args.json) fmt::print("prefill: {}\n", setup(args.smoke).description);
      for (int n : args.tokens) {
        // Registered names carry Google Benchmark's suffixes ("/512/min_time:2.000/real_time").
        auto seconds = [&](const std::string& key) {
          const auto found = runs_with_prefix(runs, key + "/");
          return found.empty() ? 0.0 : found.front()->seconds_per_iteration;
        };
        const double fwd = seconds(fmt::format("prefill/forward/{}", n));
        for (const char* name : {"forward", "scatter", "statefile"}) {
          const std::string key = fmt::format("prefill/{}/{}", name, n);
          const double sec = seconds(key);
          double write_ms = 0;
          for (const RunResult* r : runs_with_prefix(runs, key + "/"))
            if (r->counters.count("write_ms")) write_ms = r->counters.at("write_ms");
          const double tps = sec > 0 ? n / sec : 0;
          if (args.json)
            fmt::print(
                "{{\"bench\":\"prefill\",\"case\":\"{}\",\"tokens\":{},\"ms\":{:.3f},\"tokens_per_s\":{:.1f},"
                "\"write_ms\":{:.3f},\"vs_forward\":{:.3f}}}\n",
                name, n, sec * 1e3, tps, write_ms, fwd > 0 ? sec / fwd : 0.0);
          else
            fmt::print(
                "  {:<10} {:>5} tokens: {:9.2f} ms  {:9.1f} tokens/s  (write {:7.2f} ms, {:.3f}x the forward pass)\n",
                name, n, sec * 1e3, tps, write_ms, fwd > 0 ? sec / fwd : 0.0);
        }
      }
      return 0;
    },
    {},
    {512},
    {16},
});

}  // namespace
}  // namespace kvshare::bench
