// kvshare-bench remote: the remote route's transfer (UCX active messages, received into
// the decoder's own pages after the bounds check) against memcpy of the same ranges and
// against the file route (state file written and read back), at 307 and 4096 tokens; and
// the first token after a remote prefill + adopt against the decoder prefilling itself.
// All in one process over UCX (UCX_TLS defaults to tcp here, as between two hosts without
// an RDMA NIC); the ratios are printed side by side from the same run.
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "apps/decoder/refmodel_engine.h"
#include "apps/provider/remote_prefill.h"
#include "bench_registry.h"
#include "kvshare/region/importer.h"
#include "kvshare/remote/remote_receiver.h"
#include "kvshare/remote/remote_sender.h"
#include "kvshare/share/broker.h"
#include "kvshare/statefile/state_file_reader.h"
#include "kvshare/statefile/state_file_writer.h"
#include "layout/model_shape.h"
#include "layout/remote_grant.h"
#include "layout/share_header.h"

namespace kvshare::bench {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// A 0.5B-class shape (16 layers, 4 KV heads of 64, f16: 16 KiB of KV per token), so 4096
// tokens move 64 MiB; the tiny generated model's KV would be too small to time.
layout::ShareHeader transfer_header(uint32_t n_ctx) {
  layout::GgufMetadata m;
  auto u32 = [&](const std::string& key, uint32_t v) { m.set("llama." + key, layout::GgufValue{v}); };
  m.set("general.architecture", layout::GgufValue{std::string("llama")});
  u32("block_count", 16);
  u32("context_length", 32768);
  u32("embedding_length", 1024);
  u32("feed_forward_length", 4096);
  u32("attention.head_count", 16);
  u32("attention.head_count_kv", 4);
  u32("attention.key_length", 64);
  u32("attention.value_length", 64);
  auto shape = layout::derive_model_shape(m);
  layout::KvParams params;
  params.n_ctx = n_ctx;
  auto header = layout::make_share_header(layout::ModelFingerprint{"llama"}, *shape, params);
  return *header;
}

uint32_t ctx_for(uint32_t n_tokens) { return (n_tokens + 1 + 255) / 256 * 256; }

// The decoder's chunks and receiver, and a provider's staging buffer with every granted
// byte filled, for one token count.
struct TransferSetup {
  layout::ShareHeader header;
  std::vector<std::vector<std::byte>> decoder_chunks;
  std::vector<std::vector<std::byte>> staging;
  std::unique_ptr<remote::RemoteReceiver> receiver;
  std::string skip;

  explicit TransferSetup(uint32_t n_tokens) : header(transfer_header(ctx_for(n_tokens))) {
    ::setenv("UCX_TLS", "tcp", 0);
    for (const auto& c : header.layout.chunks) {
      decoder_chunks.emplace_back(c.size_bytes, std::byte{0});
      staging.emplace_back(c.size_bytes, std::byte{0x3c});
    }
    std::vector<std::span<std::byte>> spans(decoder_chunks.begin(), decoder_chunks.end());
    auto r = remote::RemoteReceiver::start(header, spans, [](const std::string&) {});
    if (!r)
      skip = r.error().what();
    else
      receiver = std::move(*r);
  }
  std::vector<layout::ChunkRange> ranges(uint32_t n) const {
    std::vector<layout::ChunkRange> out;
    for (const auto& layer : header.memory.kv_caches[0].layers)
      for (const auto& r : layout::cell_ranges(header.layout, header.memory, layer.il, 0, 0, n)) out.push_back(r);
    return out;
  }
};

void set_bytes_rate(benchmark::State& state, uint64_t bytes) {
  state.counters["bytes_per_s"] = benchmark::Counter(
      static_cast<double>(bytes) * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["bytes"] = static_cast<double>(bytes);
}

void bm_ucx(benchmark::State& state) {
  const auto n = static_cast<uint32_t>(state.range(0));
  TransferSetup setup(n);
  if (!setup.skip.empty()) return state.SkipWithError(setup.skip.c_str());
  const auto ranges = setup.ranges(n);
  uint64_t bytes = 0;
  for (auto _ : state) {
    auto offer = setup.receiver->grant({.n_cells = n});
    auto sender = remote::RemoteSender::connect(offer->worker_address);
    if (!sender) return state.SkipWithError(sender.error().what().c_str());
    for (const auto& r : ranges)
      if (auto ok = (*sender)->write({offer->share_id, offer->secret, r.chunk, r.offset, r.size_bytes},
                                     std::span(setup.staging[r.chunk]).subspan(r.offset, r.size_bytes));
          !ok)
        return state.SkipWithError(ok.error().what().c_str());
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    if (auto ok = (*sender)->flush(deadline); !ok) return state.SkipWithError(ok.error().what().c_str());
    bytes = (*sender)->bytes_sent();
    if (auto ok = (*sender)->finish({offer->share_id, offer->secret, n, bytes, offer->layout_hash}, deadline); !ok)
      return state.SkipWithError(ok.error().what().c_str());
    if (auto ok = setup.receiver->complete(offer->share_id, n); !ok)
      return state.SkipWithError(ok.error().what().c_str());
  }
  set_bytes_rate(state, bytes);
}

void bm_memcpy(benchmark::State& state) {
  const auto n = static_cast<uint32_t>(state.range(0));
  TransferSetup setup(n);
  const auto ranges = setup.ranges(n);
  uint64_t bytes = 0;
  for (auto _ : state) {
    bytes = 0;
    for (const auto& r : ranges) {
      std::memcpy(setup.decoder_chunks[r.chunk].data() + r.offset, setup.staging[r.chunk].data() + r.offset,
                  r.size_bytes);
      bytes += r.size_bytes;
    }
    benchmark::ClobberMemory();
  }
  set_bytes_rate(state, bytes);
}

void bm_file(benchmark::State& state) {
  const auto n = static_cast<uint32_t>(state.range(0));
  TransferSetup setup(n);
  const layout::KvCacheShape& cache = setup.header.memory.kv_caches[0];
  const std::vector<int32_t> tokens(n, 7);
  const fs::path path = fs::temp_directory_path() / fmt::format("kvshare-bench-remote-{}.state", ::getpid());
  uint64_t bytes = 0;
  for (auto _ : state) {
    auto writer = statefile::StateFileWriter::create(path, setup.header.memory, tokens, static_cast<int32_t>(n));
    if (!writer) return state.SkipWithError(writer.error().what().c_str());
    for (const auto& layer : cache.layers) {
      const auto* k = setup.header.layout.find(0, layer.il, layout::TensorKind::k);
      const auto* v = setup.header.layout.find(0, layer.il, layout::TensorKind::v);
      const statefile::RowsView kr{cache.type_k, setup.staging[k->chunk].data() + k->offset, n, k->tensor.row_bytes};
      const statefile::RowsView vr{cache.type_v, setup.staging[v->chunk].data() + v->offset, n, v->tensor.row_bytes};
      if (auto ok = writer->write_layer(layer.il, kr, vr); !ok) return state.SkipWithError(ok.error().what().c_str());
    }
    if (auto ok = writer->commit(); !ok) return state.SkipWithError(ok.error().what().c_str());
    auto file = statefile::read_state_file(path, &setup.header.memory);
    if (!file) return state.SkipWithError(file.error().what().c_str());
    bytes = 0;
    for (const layout::StateSection* section : file->sections()) {
      const auto* t = setup.header.layout.find(0, section->il, section->kind);
      const std::vector<std::byte> rows = file->rows(*section);
      std::memcpy(setup.decoder_chunks[t->chunk].data() + t->offset, rows.data(), rows.size());
      bytes += rows.size();
    }
  }
  std::error_code ec;
  fs::remove(path, ec);
  set_bytes_rate(state, bytes);
}

// First token: a remote prefill (provider, receiver and decoder in this process, KV over
// UCX) then the decoder's one-token eval, against the decoder evaluating the whole prompt
// itself. As on the route, the receiver maps the decoder's exported region, received by the
// share handshake, and registers it once: here before the timed loop.
struct FirstTokenSetup {
  std::string skip;
  std::unique_ptr<decoder::SlotEngine> engine;
  std::unique_ptr<refmodel::RemotePrefiller> prefiller;
  std::optional<ImportedShare> region;
  std::unique_ptr<remote::RemoteReceiver> receiver;
  uint64_t share_id = 0;  // the decoder's, for the adopt

  FirstTokenSetup(uint32_t n_tokens, bool smoke) {
    ::setenv("UCX_TLS", "tcp", 0);
    const fs::path model = fs::temp_directory_path() / fmt::format("kvshare-bench-remote-{}.gguf", ::getpid());
    const std::string command = fmt::format("{} {} --ctx 8192 --seed 3 > /dev/null 2>&1",
                                            (fs::path(KVSHARE_BIN_DIR) / "kvshare-mkmodel").string(), model.string());
    if (std::system(command.c_str()) != 0) {
      skip = "kvshare-mkmodel failed (is it built?)";
      return;
    }
    decoder::RefEngineOptions options;
    options.model_path = model;
    options.params.n_ctx = smoke ? 256 : 8192;
    options.share_requested = true;
    options.n_threads = 1;
    auto e = decoder::load_refmodel_engine(options);
    auto p = refmodel::RemotePrefiller::load(model.string(), 1);
    std::error_code ec;
    fs::remove(model, ec);  // both mapped it already
    if (!e || !p) {
      skip = !e ? e.error().what() : p.error().what();
      return;
    }
    engine = std::move(*e);
    prefiller = std::move(*p);
    auto broker = ShareBroker::listen();
    if (!broker) {
      skip = broker.error().what();
      return;
    }
    auto shared = engine->share(broker->socket_path());
    auto share = shared ? broker->receive(10000) : Result<ReceivedShare>(fail(shared.error()));
    if (!share) {
      skip = share.error().what();
      return;
    }
    share_id = share->share_id;
    std::vector<uint64_t> offsets;
    for (const auto& entry : share->entries) offsets.push_back(entry.offset);
    auto imported = ImportedShare::import(share->header.layout, std::move(share->fds), offsets, true);
    if (!imported) {
      skip = imported.error().what();
      return;
    }
    region.emplace(std::move(*imported));
    const auto chunks = region->chunk_bytes();
    auto r = remote::RemoteReceiver::start(
        share->header, std::vector<std::span<std::byte>>(chunks.begin(), chunks.end()), [](const std::string&) {});
    if (!r) {
      skip = r.error().what();
      return;
    }
    receiver = std::move(*r);
    (void)n_tokens;
  }
};

std::vector<int32_t> prompt(uint32_t n) {
  std::vector<int32_t> ids(n);
  for (uint32_t i = 0; i < n; ++i)
    ids[i] = static_cast<int32_t>(10 + (i * 37) % 100);  // the generated vocabulary has 134 ids
  return ids;
}

void bm_first_token_remote(benchmark::State& state, bool smoke) {
  const auto n = static_cast<uint32_t>(state.range(0));
  FirstTokenSetup setup(n, smoke);
  if (!setup.skip.empty()) return state.SkipWithError(setup.skip.c_str());
  const auto ids = prompt(n);
  const std::span<const int32_t> head(ids.data(), n - 1);
  for (auto _ : state) {
    auto offer = setup.receiver->grant({.n_cells = n - 1});
    if (!offer) return state.SkipWithError(offer.error().what().c_str());
    auto pushed = setup.prefiller->run(head, *offer);
    if (!pushed) return state.SkipWithError(pushed.error().what().c_str());
    state.counters["forward_ms"] = pushed->forward_ms;
    state.counters["transfer_ms"] = pushed->transfer_ms;
    if (auto completed = setup.receiver->complete(offer->share_id, n - 1); !completed)
      return state.SkipWithError(completed.error().what().c_str());
    if (auto adopted = setup.engine->adopt(head, setup.share_id); !adopted)
      return state.SkipWithError(adopted.error().error.what().c_str());
    auto logits = setup.engine->eval(std::span(ids).subspan(n - 1), static_cast<int32_t>(n - 1));
    if (!logits) return state.SkipWithError(logits.error().what().c_str());
  }
}

void bm_first_token_self(benchmark::State& state, bool smoke) {
  const auto n = static_cast<uint32_t>(state.range(0));
  FirstTokenSetup setup(n, smoke);
  if (!setup.skip.empty()) return state.SkipWithError(setup.skip.c_str());
  const auto ids = prompt(n);
  for (auto _ : state) {
    auto logits = setup.engine->eval(ids, 0);
    if (!logits) return state.SkipWithError(logits.error().what().c_str());
  }
}

const bool registered = add_group({
    "remote",
    "remote route: UCX transfer bytes/s vs memcpy and the file route; first token vs the decoder's own prefill",
    [](const BenchArgs& args) {
      for (int n : args.tokens) {
        const int iterations = args.smoke ? 1 : (n > 1000 ? 3 : 10);
        benchmark::RegisterBenchmark(fmt::format("remote/ucx/{}", n).c_str(), bm_ucx)
            ->Arg(n)
            ->Iterations(iterations)
            ->UseRealTime();
        benchmark::RegisterBenchmark(fmt::format("remote/memcpy/{}", n).c_str(), bm_memcpy)
            ->Arg(n)
            ->Iterations(iterations)
            ->UseRealTime();
        benchmark::RegisterBenchmark(fmt::format("remote/file/{}", n).c_str(), bm_file)
            ->Arg(n)
            ->Iterations(iterations)
            ->UseRealTime();
        const bool smoke = args.smoke;
        benchmark::RegisterBenchmark(fmt::format("remote/first_remote/{}", n).c_str(),
                                     [smoke](benchmark::State& s) { bm_first_token_remote(s, smoke); })
            ->Arg(n)
            ->Iterations(1)
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
        benchmark::RegisterBenchmark(fmt::format("remote/first_self/{}", n).c_str(),
                                     [smoke](benchmark::State& s) { bm_first_token_self(s, smoke); })
            ->Arg(n)
            ->Iterations(1)
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
      }
    },
    [](const std::vector<RunResult>& runs, const BenchArgs& args) {
      // Run names carry the arg, iteration count and "real_time" after the case name.
      auto run_of = [&](const std::string& name) -> const RunResult* {
        for (const RunResult* r : runs_with_prefix(runs, name + "/")) return r;
        return nullptr;
      };
      auto counter = [&](const std::string& name, const char* key) {
        const RunResult* r = run_of(name);
        return r != nullptr && r->counters.count(key) ? r->counters.at(key) : 0.0;
      };
      auto rate = [&](const std::string& name) { return counter(name, "bytes_per_s"); };
      auto bytes = [&](const std::string& name) { return counter(name, "bytes"); };
      auto seconds = [&](const std::string& name) {
        const RunResult* r = run_of(name);
        return r != nullptr ? r->seconds_per_iteration : 0.0;
      };
      auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
      if (!args.json)
        fmt::print("{:>7} {:>10} {:>12} {:>12} {:>12} {:>9} {:>9} {:>13} {:>13} {:>9}\n", "tokens", "MiB", "ucx MB/s",
                   "memcpy MB/s", "file MB/s", "ucx/mcpy", "ucx/file", "1st remote ms", "1st self ms", "self/rem");
      for (int n : args.tokens) {
        const std::string s = std::to_string(n);
        const double ucx = rate("remote/ucx/" + s), mc = rate("remote/memcpy/" + s), file = rate("remote/file/" + s);
        const double first_remote = 1e3 * seconds("remote/first_remote/" + s);
        const double first_self = 1e3 * seconds("remote/first_self/" + s);
        const double forward_ms = counter("remote/first_remote/" + s, "forward_ms");
        const double transfer_ms = counter("remote/first_remote/" + s, "transfer_ms");
        if (args.json) {
          fmt::print(
              "{{\"bench\":\"remote\",\"tokens\":{},\"bytes\":{:.0f},\"ucx_bytes_per_s\":{:.0f},\"memcpy_bytes_per_s\":"
              "{:.0f},\"file_bytes_per_s\":{:.0f},\"first_token_remote_ms\":{:.3f},\"first_token_self_ms\":{:.3f},"
              "\"provider_forward_ms\":{:.3f},\"provider_transfer_ms\":{:.3f}}}\n",
              n, bytes("remote/ucx/" + s), ucx, mc, file, first_remote, first_self, forward_ms, transfer_ms);
        } else {
          fmt::print("{:>7} {:>10.2f} {:>12.1f} {:>12.1f} {:>12.1f} {:>9.3f} {:>9.3f} {:>13.3f} {:>13.3f} {:>9.2f}\n",
                     n, bytes("remote/ucx/" + s) / (1 << 20), ucx / 1e6, mc / 1e6, file / 1e6, ratio(ucx, mc),
                     ratio(ucx, file), first_remote, first_self, ratio(first_self, first_remote));
          fmt::print(
              "{:>7} first remote = provider forward {:.3f} ms + placing/sending {:.3f} ms + connect, adopt, "
              "one eval\n",
              "", forward_ms, transfer_ms);
        }
      }
      if (!args.json)
        fmt::print(
            "UCX_TLS={} (one process, loopback: no RDMA NIC); first token = prefill (+ transfer + adopt) + one eval\n",
            std::getenv("UCX_TLS") ? std::getenv("UCX_TLS") : "default");
      return 0;
    },
    {},
    {307, 4096},
    {16},
});

}  // namespace
}  // namespace kvshare::bench
