#include "apps/provider/prefill_routes.h"

#include <fmt/format.h>

#include <chrono>

#include "apps/provider/private_kv.h"
#include "kvshare/mapping.h"
#include "kvshare/region/dmabuf_sync.h"
#include "kvshare/scatter/scatter.h"
#include "kvshare/statefile/state_file_writer.h"
#include "layout/memory_shape.h"
#include "layout/share_layout.h"
#include "refmodel/model_impl.h"

namespace kvshare::refmodel {
namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// The incremental shared route: a Context over the region itself, exactly as the decoder
// runs on it (kvshare-decoder's eval is the same Context::decode), so the cached cells
// are read in the decoder's cache types and rotation and the new ones stored the same
// way. Creating the Context only checks the layout; decode writes cells n_cached.. only.
// A prefill's report once it is done: the wall time since t0, of which write_ms went to
// storing the rows (the rest is the forward pass).
PrefillReport finished_report(const char* route, uint32_t n_tokens, uint32_t n_prefilled, Clock::time_point t0,
                              double write_ms) {
  PrefillReport report;
  report.route = route;
  report.n_tokens = n_tokens;
  report.n_prefilled = n_prefilled;
  report.prefill_ms = ms_since(t0);
  report.write_ms = write_ms;
  report.forward_ms = report.prefill_ms - write_ms;
  return report;
}

Result<PrefillReport> extend_region(const ProviderModel& model, const RegionTarget& target,
                                    std::span<const int32_t> ids, uint32_t n_cached, int n_threads,
                                    const IdsSource& source) {
  const auto chunks = target.imported.chunk_bytes();
  KvMemory kv{target.header.memory, target.header.layout,
              std::vector<std::span<std::byte>>(chunks.begin(), chunks.end())};
  // The reference transformer holds one sequence: it reads and writes the slot's stream only.
  if (auto narrowed = layout::narrow_to_stream(kv.memory, kv.layout, target.stream); !narrowed)
    return fail(narrowed.error().with_context(fmt::format("shared route, {} {}", source.stream, target.stream)));
  auto ctx = Context::create(model.model, std::move(kv), n_threads);
  if (!ctx) return fail(ctx.error().with_context("shared route, the decoder's region"));
  const auto t0 = Clock::now();
  const std::span<const int32_t> rest = ids.subspan(n_cached);
  auto logits = (*ctx)->decode(rest, static_cast<int32_t>(n_cached));
  if (!logits)
    return fail(logits.error().with_context(
        fmt::format("shared route, {} {}: positions {}..{}", source.cached, n_cached, n_cached, ids.size() - 1)));
  // The stores into the region are part of the forward pass: no write time of its own.
  return finished_report("shared", static_cast<uint32_t>(ids.size()), static_cast<uint32_t>(rest.size()), t0, 0);
}

// The whole prompt from position 0: the provider's own cache for the attention, each
// layer's rows scattered into the region as the layer completes.
Result<PrefillReport> scatter_into_region(const ProviderModel& model, const RegionTarget& target,
                                          std::span<const int32_t> ids, int n_threads, PrivateContext& own) {
  const layout::ShareHeader& header = target.header;
  const auto n = static_cast<uint32_t>(ids.size());
  auto ctx = own.get(model.model, header.params, n, n_threads);
  if (!ctx) return fail(ctx.error());

  const auto chunks = target.imported.chunk_bytes();
  kvshare::ScatterTarget scatter_target{header.layout,
                                        header.memory,
                                        std::vector<std::span<std::byte>>(chunks.begin(), chunks.end()),
                                        0,
                                        head_k(*model.model),
                                        head_v(*model.model),
                                        target.chunk_files};
  const bool rotation_disabled = statefile::attn_rotation_disabled_by_env();
  double write_ms = 0;
  const auto t0 = Clock::now();
  auto ok = (*ctx)->prefill(ids, [&](const LayerRows& rows) -> Result<void> {
    const auto w0 = Clock::now();
    kvshare::ScatterBatch batch = scatter_batch_of(rows, rotation_disabled, n_threads);
    batch.stream = target.stream;
    batch.pos0 += target.first_cell;  // a range: position p at cell first_cell + p
    auto scattered = kvshare::scatter(scatter_target, batch);
    write_ms += ms_since(w0);
    return scattered;
  });
  if (!ok) return fail(ok.error().with_context("shared route"));
  return finished_report("shared", n, n, t0, write_ms);
}

}  // namespace

Result<ProviderModel> load_provider_model(const std::string& model_path) {
  auto mapping = Mapping::map_file_readonly(model_path);
  if (!mapping) return fail(mapping.error().with_context(fmt::format("model {}", model_path)));
  auto keep = std::make_shared<Mapping>(std::move(*mapping));
  auto model = Model::from_gguf(keep->bytes(), keep, model_path);
  if (!model) return fail(model.error());
  return ProviderModel{std::move(*model), model_path};
}

Result<void> check_ids_in_vocabulary(const ProviderModel& model, std::span<const int32_t> ids,
                                     const IdsSource& source) {
  const int32_t n_vocab = model.model->tokenizer().n_vocab();
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] >= n_vocab)
      return fail(EINVAL, "{}: id {} (entry {}) is outside the vocabulary of model {} ({} tokens)", source.ids, ids[i],
                  i + 1, model.path, n_vocab);
  return {};
}

Result<layout::ShareHeader> provider_share_header(const ProviderModel& model, const layout::KvParams& params) {
  const Model& m = *model.model;
  auto ours = layout::make_share_header(layout::model_fingerprint(m.metadata(), m.tensor_infos()), m.shape(), params);
  if (!ours) return fail(ours.error().with_context(fmt::format("model {}", model.path)));
  return ours;
}

// --cached P leaves at least the last id to compute: its K/V (and the decoder's first
// logits, one token later) come from this prefill, never from a cell it did not write.
Error cached_bound_error(uint32_t n_cached, size_t n_ids, const IdsSource& source) {
  return Error(EINVAL, fmt::format("{} {}: the {} holds {} ids; {} must be below that (0 <= P < {}): "
                                   "when the region holds every id there is nothing to prefill",
                                   source.cached, n_cached, source.ids, n_ids, source.cached, n_ids));
}

Result<void> check_region_fits(const layout::ShareHeader& header, size_t n_ids, uint32_t n_cached,
                               const IdsSource& source) {
  const uint32_t kv_size = header.memory.kv_caches.empty() ? 0 : header.memory.kv_caches[0].kv_size;
  if (n_ids > kv_size)
    return fail(ERANGE, "{}: {} tokens do not fit the shared cache of {} cells", source.ids, n_ids, kv_size);
  if (n_cached >= n_ids) return fail(cached_bound_error(n_cached, n_ids, source));
  return {};
}

Result<void> check_region_cells(const layout::ShareHeader& header, uint32_t first_cell, uint32_t n_cells, size_t n_ids,
                                uint32_t n_cached, const IdsSource& source) {
  if (first_cell == 0 && n_cells == 0) return {};
  if (n_cells == 0)
    return fail(EINVAL, "{} {} without {}: a range names its cells", source.first_cell, first_cell, source.n_cells);
  if (header.memory.kv_caches.empty())
    return fail(EINVAL, "{} {} {} {}: the decoder's memory has no KV cache", source.first_cell, first_cell,
                source.n_cells, n_cells);
  for (const auto& cache : header.memory.kv_caches)
    if (uint64_t{first_cell} + n_cells > cache.kv_size)
      return fail(EINVAL, "{} {} {} {}: cells {}..{} pass the decoder's \"{}\" KV cache of kv_size {}",
                  source.first_cell, first_cell, source.n_cells, n_cells, first_cell,
                  uint64_t{first_cell} + n_cells - 1, cache.role, cache.kv_size);
  if (n_ids > n_cells)
    return fail(ERANGE, "{} {}: the {} holds {} ids, more than the share's cells {}..{}", source.n_cells, n_cells,
                source.ids, n_ids, first_cell, uint64_t{first_cell} + n_cells - 1);
  if (n_cached > 0 && first_cell > 0)
    return fail(ENOTSUP,
                "{} {} with {} {}: a share of a run of cells (a unified cache) never has cached cells; "
                "prefill the whole prompt",
                source.cached, n_cached, source.first_cell, first_cell);
  return {};
}

Result<void> check_region_stream(const layout::ShareHeader& header, uint32_t stream, uint32_t n_cached,
                                 const IdsSource& source) {
  const uint32_t n_stream = header.memory.kv_caches.empty() ? 1 : header.memory.kv_caches[0].n_stream;
  if (stream >= n_stream)
    return fail(EINVAL, "{} {}: the decoder's KV cache has n_stream {} (streams 0..{}; -np {}{})", source.stream,
                stream, n_stream, n_stream - 1, header.params.n_seq_max, header.params.kv_unified ? ", unified" : "");
  (void)n_cached;  // the incremental route reads the stream's slice (extend_region)
  return {};
}

Result<PrefillReport> prefill_region(const ProviderModel& model, const RegionTarget& target,
                                     std::span<const int32_t> ids, uint32_t n_cached, int n_threads,
                                     const IdsSource& source, PrivateContext& own) {
  if (auto known = check_ids_in_vocabulary(model, ids, source); !known) return fail(known.error());
  if (auto fits = check_region_fits(target.header, ids.size(), n_cached, source); !fits) return fail(fits.error());
  if (auto cells = check_region_cells(target.header, target.first_cell, target.n_cells, ids.size(), n_cached, source);
      !cells)
    return fail(cells.error());
  if (auto in_range = check_region_stream(target.header, target.stream, n_cached, source); !in_range)
    return fail(in_range.error());
  // With cached cells the provider reads the region as well as writing it.
  auto access =
      target.imported.begin_cpu_access(n_cached > 0 ? DmaBufCpuAccess::Mode::read_write : DmaBufCpuAccess::Mode::write);
  if (!access) return fail(access.error());
  if (n_cached > 0) return extend_region(model, target, ids, n_cached, n_threads, source);
  return scatter_into_region(model, target, ids, n_threads, own);
}

Result<PrefillReport> prefill_state_file(const ProviderModel& model, const StateFileTarget& target,
                                         std::span<const int32_t> ids, int n_threads, const IdsSource& source,
                                         PrivateContext& own) {
  if (auto known = check_ids_in_vocabulary(model, ids, source); !known) return fail(known.error());
  const layout::KvParams& params = target.params;
  if (auto ok = layout::validate(params); !ok) return fail(ok.error());
  auto memory = layout::derive_memory_shape(model.model->shape(), params);
  if (!memory)
    return fail(memory.error().with_context(fmt::format("model {} with {}", model.path, layout::describe(params))));
  const uint32_t kv_size = memory->kv_caches.empty() ? 0 : memory->kv_caches[0].kv_size;
  if (ids.size() > kv_size)
    return fail(ERANGE, "{}: {} tokens do not fit the context of {} cells ({} {})", source.ids, ids.size(), kv_size,
                source.n_ctx, params.n_ctx);
  const auto n = static_cast<uint32_t>(ids.size());
  auto ctx = own.get(model.model, params, n, n_threads);
  if (!ctx) return fail(ctx.error());

  statefile::StateFileWriterOptions options;
  options.n_embd_head_k = head_k(*model.model);
  options.n_embd_head_v = head_v(*model.model);
  options.rotation_disabled = statefile::attn_rotation_disabled_by_env();
  options.state_version = target.state_version;
  const auto t0 = Clock::now();
  auto writer = statefile::StateFileWriter::create(target.path, *memory, ids, static_cast<int32_t>(n), options);
  if (!writer) return fail(writer.error().with_context(fmt::format("state file {}", target.path)));
  double write_ms = 0;
  auto ok = (*ctx)->prefill(ids, [&](const LayerRows& rows) -> Result<void> {
    const auto w0 = Clock::now();
    const uint64_t stride = (rows.n_embd_k_gqa + rows.n_embd_v_gqa) * sizeof(float);
    const statefile::RowsView k{layout::GgmlType::F32, rows.rows.data(), rows.n_tokens, stride};
    const statefile::RowsView v{layout::GgmlType::F32, rows.rows.data() + rows.n_embd_k_gqa, rows.n_tokens, stride};
    auto written = writer->write_layer(rows.il, k, v);
    write_ms += ms_since(w0);
    return written;
  });
  if (!ok) return fail(ok.error().with_context(fmt::format("state file {}", target.path)));
  const auto c0 = Clock::now();
  auto committed = writer->commit();
  if (!committed) return fail(committed.error().with_context(fmt::format("state file {}", target.path)));
  write_ms += ms_since(c0);
  return finished_report("file", n, n, t0, write_ms);
}

}  // namespace kvshare::refmodel
