#include "apps/provider/remote_prefill.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "apps/provider/private_kv.h"
#include "apps/provider/provider_command.h"
#include "kvshare/mapping.h"
#include "kvshare/remote/remote_sender.h"
#include "kvshare/scatter/scatter.h"
#include "kvshare/statefile/state_file_reader.h"
#include "kvshare/statefile/state_file_writer.h"
#include "layout/remote_grant.h"
#include "layout/share_header.h"
#include "layout/tensor_type.h"
#include "refmodel/engine.h"
#include "route/decoder_process.h"
#include "route/provider_run.h"

namespace kvshare::refmodel {
namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

}  // namespace

struct RemotePrefiller::Impl {
  std::string model_path;
  int n_threads = 0;
  std::shared_ptr<const Model> model;
};

RemotePrefiller::RemotePrefiller(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RemotePrefiller::~RemotePrefiller() = default;

Result<std::unique_ptr<RemotePrefiller>> RemotePrefiller::load(const std::string& model_path, int n_threads) {
  auto mapping = Mapping::map_file_readonly(model_path);
  if (!mapping) return fail(mapping.error().with_context(fmt::format("model {}", model_path)));
  auto keep = std::make_shared<Mapping>(std::move(*mapping));
  auto model = Model::from_gguf(keep->bytes(), keep, model_path);
  if (!model) return fail(model.error().with_context(fmt::format("model {}", model_path)));
  auto impl = std::make_unique<Impl>();
  impl->model_path = model_path;
  impl->n_threads = n_threads;
  impl->model = std::move(*model);
  return std::unique_ptr<RemotePrefiller>(new RemotePrefiller(std::move(impl)));
}

int32_t RemotePrefiller::n_vocab() const { return impl_->model->tokenizer().n_vocab(); }
std::shared_ptr<const Model> RemotePrefiller::model() const { return impl_->model; }

namespace {

// The offer against this model and the tokens: EINVAL naming the field, before any
// connection (compatibility first, vLLM PR #29503).
Result<void> check_offer(const Model& model, const std::string& model_path, std::span<const int32_t> tokens,
                         const remote::RemoteOffer& offer) {
  auto ours = layout::make_share_header(layout::model_fingerprint(model.metadata(), model.tensor_infos()),
                                        model.shape(), offer.header.params);
  if (!ours) return fail(ours.error().with_context(fmt::format("model {}", model_path)));
  if (auto ok = layout::check_compatible(*ours, offer.header, "the decoder's offer"); !ok)
    return fail(ok.error().with_context(fmt::format("model {}", model_path)));
  if (tokens.empty()) return fail(EINVAL, "no tokens to prefill");
  if (tokens.size() > offer.n_cells)
    return fail(EINVAL, "{} tokens, the decoder granted {} cells", tokens.size(), offer.n_cells);
  if (tokens.size() <= offer.n_cached)
    return fail(EINVAL, "{} tokens, the decoder holds the first {} (n_cached): nothing to send", tokens.size(),
                offer.n_cached);
  if (auto grant = remote::offer_grant(offer); !grant) return fail(grant.error());
  const int32_t vocab = model.tokenizer().n_vocab();
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= vocab)
      return fail(EINVAL, "tokens[{}] is {}, outside the vocabulary of model {} ({} tokens)", i, tokens[i], model_path,
                  vocab);
  return {};
}

// Rows are placed here first, exactly as they will sit in the decoder's chunks, then sent
// range by range. Uninitialised: only the granted cells are touched, so untouched pages
// of a large context cost nothing.
struct Staging {
  std::vector<std::unique_ptr<std::byte[]>> owned;
  std::vector<std::span<std::byte>> chunks;
  explicit Staging(const layout::ShareLayout& share_layout) {
    for (const layout::ShareChunk& chunk : share_layout.chunks) {
      owned.emplace_back(new std::byte[chunk.size_bytes]);
      chunks.emplace_back(owned.back().get(), chunk.size_bytes);
    }
  }
};

// The cells of prompt positions [pos_begin, pos_end) that the offer grants: position p in
// cell first_cell + p, positions below n_cached not at all. Empty (begin == end) when none.
struct CellSpan {
  uint32_t begin = 0;
  uint32_t end = 0;
};
CellSpan granted_cells_of(const remote::RemoteOffer& offer, uint32_t pos_begin, uint32_t pos_end) {
  const uint32_t from = std::max(pos_begin, offer.n_cached);
  if (from >= pos_end) return {};
  return {offer.first_cell + from, offer.first_cell + pos_end};
}

// One write per K/V tensor (per element row of a transposed V) of cells [begin, end) of
// the offer's stream of layer `il`: a layer's rows go as a few large messages, never a
// descriptor per token.
Result<void> send_cells(remote::RemoteSender& sender, const remote::RemoteOffer& offer, const Staging& staging,
                        uint32_t il, CellSpan cells) {
  for (const layout::ChunkRange& r :
       layout::cell_ranges(offer.header.layout, offer.header.memory, il, offer.stream, cells.begin, cells.end))
    if (auto sent = sender.write({offer.share_id, offer.secret, r.chunk, r.offset, r.size_bytes},
                                 staging.chunks[r.chunk].subspan(r.offset, r.size_bytes));
        !sent)
      return sent;
  return {};
}

// Flush, then the completion with the bytes the decoder accepted.
Result<uint64_t> finish(remote::RemoteSender& sender, const remote::RemoteOffer& offer, uint32_t n,
                        Clock::time_point deadline) {
  if (auto flushed = sender.flush(deadline); !flushed) return fail(flushed.error().with_context("remote route"));
  const layout::RemoteDone done{offer.share_id, offer.secret, n, sender.bytes_sent(), offer.layout_hash};
  if (auto finished = sender.finish(done, deadline); !finished)
    return fail(finished.error().with_context("remote route"));
  return done.bytes;
}

}  // namespace

Result<RemotePrefillReport> RemotePrefiller::run(std::span<const int32_t> tokens, const remote::RemoteOffer& offer) {
  const Model& model = *impl_->model;
  const auto t0 = Clock::now();
  const auto deadline = t0 + std::chrono::milliseconds(offer.timeout_ms);
  if (auto ok = check_offer(model, impl_->model_path, tokens, offer); !ok) return fail(ok.error());
  const layout::ShareLayout& share_layout = offer.header.layout;
  const layout::MemoryShape& memory = offer.header.memory;
  Staging staging(share_layout);
  auto sender = remote::RemoteSender::connect(offer.worker_address);
  if (!sender) return fail(sender.error());
  const auto n = static_cast<uint32_t>(tokens.size());
  auto own = make_private_kv(model, offer.header.params, n);
  if (!own) return fail(own.error());
  auto ctx = Context::create(impl_->model, (*own)->kv, impl_->n_threads);
  if (!ctx) return fail(ctx.error());
  kvshare::ScatterTarget target{share_layout, memory, staging.chunks, 0, head_k(model), head_v(model)};
  const bool rotation_disabled = statefile::attn_rotation_disabled_by_env();
  double transfer_ms = 0;
  auto ok = (*ctx)->prefill(tokens, [&](const LayerRows& rows) -> Result<void> {
    const auto w0 = Clock::now();
    const auto pos_begin = static_cast<uint32_t>(rows.pos0);
    const CellSpan cells = granted_cells_of(offer, pos_begin, pos_begin + rows.n_tokens);
    if (cells.begin == cells.end) return {};  // the decoder holds these positions
    // Only the granted positions are placed: the rows from the first of them on, in
    // cells first_cell + p of the offer's stream.
    kvshare::ScatterBatch batch = scatter_batch_of(rows, rotation_disabled, impl_->n_threads);
    const uint32_t skipped = cells.begin - offer.first_cell - pos_begin;
    batch.layers.front().data = static_cast<const std::byte*>(batch.layers.front().data) + skipped * batch.row_stride;
    batch.pos0 = cells.begin;
    batch.n_tokens = cells.end - cells.begin;
    batch.stream = offer.stream;
    if (auto scattered = kvshare::scatter(target, batch); !scattered) return scattered;
    if (auto sent = send_cells(**sender, offer, staging, rows.il, cells); !sent) return sent;
    transfer_ms += ms_since(w0);
    if (Clock::now() > deadline) return fail(ETIMEDOUT, "the offer's deadline passed during the prefill");
    return {};
  });
  if (!ok) return fail(ok.error().with_context("remote route"));
  const auto f0 = Clock::now();
  auto bytes = finish(**sender, offer, n, deadline);
  if (!bytes) return fail(bytes.error());
  transfer_ms += ms_since(f0);
  RemotePrefillReport report;
  report.n_tokens = n;
  report.prefill_ms = ms_since(t0);
  report.transfer_ms = transfer_ms;
  report.forward_ms = report.prefill_ms - transfer_ms;
  report.bytes_sent = *bytes;
  report.n_sent = n - offer.n_cached;
  return report;
}

Result<RemotePrefillReport> RemotePrefiller::run_command(std::span<const int32_t> tokens,
                                                         const remote::RemoteOffer& offer, const std::string& command,
                                                         std::chrono::milliseconds timeout) {
  const auto t0 = Clock::now();
  const auto deadline = t0 + std::chrono::milliseconds(offer.timeout_ms);
  if (auto ok = check_offer(*impl_->model, impl_->model_path, tokens, offer); !ok) return fail(ok.error());
  auto dir = route::make_private_dir("kvshare-provider-server");
  if (!dir) return fail(dir.error());
  struct RemoveDir {
    std::filesystem::path path;
    ~RemoveDir() {
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
    }
  } remove_dir{*dir};
  const std::filesystem::path state_path = *dir / "prompt.state";
  // One sequence, as before streams: only the rows are read from the file, and they are
  // placed in the offer's stream here.
  layout::KvParams params = offer.header.params;
  params.n_seq_max = 1;
  params.kv_unified = true;
  auto ran = run_provider_command(command, *dir, state_path, impl_->model_path, params, 0, tokens, timeout);
  if (!ran) return fail(ran.error());
  const double forward_ms = *ran;
  const auto w0 = Clock::now();
  const layout::MemoryShape& memory = offer.header.memory;
  auto file = statefile::read_state_file(state_path, &memory);
  if (!file) return fail(EIO, "the provider command's state file: {}", file.error().what());
  if (!std::equal(file->tokens().begin(), file->tokens().end(), tokens.begin(), tokens.end()))
    return fail(EIO, "the provider command's state file holds {} other tokens than the {} asked for",
                file->tokens().size(), tokens.size());
  const auto n = static_cast<uint32_t>(tokens.size());
  const layout::KvCacheShape& cache = memory.kv_caches.front();
  // The file holds positions 0..n-1 in cell order; positions n_cached..n-1 are placed in
  // cells first_cell + p of the offer's stream, as kvshare::scatter would place them.
  const CellSpan cells = granted_cells_of(offer, 0, n);
  const uint32_t first_sent = offer.n_cached;
  Staging staging(offer.header.layout);
  for (const layout::StateSection* section : file->sections()) {
    const layout::SharedTensor* t = offer.header.layout.find(0, section->il, section->kind);
    if (t == nullptr || section->n_rows != n)
      return fail(EIO, "the provider command's state file: section {} of layer {} has {} rows, expected {}",
                  layout::tensor_kind_name(section->kind), section->il, section->n_rows, n);
    const std::vector<std::byte> rows = file->rows(*section);  // cell order
    std::byte* stream_base = staging.chunks[t->chunk].data() + t->offset +
                             static_cast<uint64_t>(offer.stream) * cache.kv_size * t->tensor.row_bytes;
    if (section->kind == layout::TensorKind::v && cache.v_trans) {
      // Element j of cell c at (j * kv_size + c) * element, as kvshare::scatter places it.
      const uint64_t elem = layout::ggml_row_size(cache.type_v, 1);
      for (uint32_t p = first_sent; p < n; ++p)
        for (uint32_t j = 0; j < section->n_embd; ++j)
          std::memcpy(stream_base + (static_cast<uint64_t>(j) * cache.kv_size + offer.first_cell + p) * elem,
                      rows.data() + (static_cast<uint64_t>(p) * section->n_embd + j) * elem, elem);
    } else {
      if (rows.size() != static_cast<uint64_t>(n) * t->tensor.row_bytes)
        return fail(EIO, "the provider command's state file: layer {} {} rows are {} bytes, the layout says {}",
                    section->il, layout::tensor_kind_name(section->kind), rows.size(),
                    static_cast<uint64_t>(n) * t->tensor.row_bytes);
      std::memcpy(stream_base + static_cast<uint64_t>(cells.begin) * t->tensor.row_bytes,
                  rows.data() + static_cast<uint64_t>(first_sent) * t->tensor.row_bytes,
                  static_cast<uint64_t>(n - first_sent) * t->tensor.row_bytes);
    }
  }
  auto sender = remote::RemoteSender::connect(offer.worker_address);
  if (!sender) return fail(sender.error());
  for (const layout::KvCacheLayer& layer : cache.layers)
    if (auto sent = send_cells(**sender, offer, staging, layer.il, cells); !sent)
      return fail(sent.error().with_context("remote route"));
  auto bytes = finish(**sender, offer, n, deadline);
  if (!bytes) return fail(bytes.error());
  RemotePrefillReport report;
  report.n_tokens = n;
  report.forward_ms = forward_ms;
  report.transfer_ms = ms_since(w0);
  report.prefill_ms = ms_since(t0);
  report.bytes_sent = *bytes;
  report.n_sent = n - offer.n_cached;
  return report;
}

}  // namespace kvshare::refmodel
