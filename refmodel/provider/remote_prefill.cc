#include "refmodel/provider/remote_prefill.h"

#include <fmt/format.h>

#include <chrono>

#include "kvshare/mapping.h"
#include "kvshare/remote/remote_sender.h"
#include "kvshare/statefile/state_file_writer.h"
#include "layout/remote_grant.h"
#include "layout/share_header.h"
#include "refmodel/engine.h"
#include "refmodel/provider/private_kv.h"
#include "xdna/scatter.h"

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

Result<RemotePrefillReport> RemotePrefiller::run(std::span<const int32_t> tokens, const remote::RemoteOffer& offer) {
  const Model& model = *impl_->model;
  const auto t0 = Clock::now();
  const auto deadline = t0 + std::chrono::milliseconds(offer.timeout_ms);
  // Compatibility first, before any connection: the decoder's layout must be the one
  // this model gives for the decoder's params (field by field, named on refusal).
  auto ours = layout::make_share_header(layout::model_fingerprint(model.metadata(), model.tensor_infos()),
                                        model.shape(), offer.header.params);
  if (!ours) return fail(ours.error().with_context(fmt::format("model {}", impl_->model_path)));
  if (auto ok = layout::check_compatible(*ours, offer.header, "the decoder's offer"); !ok)
    return fail(ok.error().with_context(fmt::format("model {}", impl_->model_path)));
  if (tokens.empty()) return fail(EINVAL, "no tokens to prefill");
  if (tokens.size() > offer.n_cells)
    return fail(EINVAL, "{} tokens, the decoder granted {} cells", tokens.size(), offer.n_cells);
  const int32_t vocab = n_vocab();
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= vocab)
      return fail(EINVAL, "tokens[{}] is {}, outside the vocabulary of model {} ({} tokens)", i, tokens[i],
                  impl_->model_path, vocab);
  const layout::ShareLayout& share_layout = offer.header.layout;
  const layout::MemoryShape& memory = offer.header.memory;

  // Rows are placed here first, exactly as they will sit in the decoder's chunks (one
  // conversion, xdna::scatter), then sent range by range. Uninitialised: only the
  // granted cells are touched, so untouched pages of a large context cost nothing.
  std::vector<std::unique_ptr<std::byte[]>> staging;
  std::vector<std::span<std::byte>> staging_spans;
  for (const layout::ShareChunk& chunk : share_layout.chunks) {
    staging.emplace_back(new std::byte[chunk.size_bytes]);
    staging_spans.emplace_back(staging.back().get(), chunk.size_bytes);
  }

  auto sender = remote::RemoteSender::connect(offer.worker_address);
  if (!sender) return fail(sender.error());
  const auto n = static_cast<uint32_t>(tokens.size());
  auto own = make_private_kv(model, offer.header.params, n);
  if (!own) return fail(own.error());
  auto ctx = Context::create(impl_->model, (*own)->kv, impl_->n_threads);
  if (!ctx) return fail(ctx.error());
  xdna::ScatterTarget target{share_layout, memory, staging_spans, 0, head_k(model), head_v(model)};
  const bool rotation_disabled = statefile::attn_rotation_disabled_by_env();
  double transfer_ms = 0;
  auto ok = (*ctx)->prefill(tokens, [&](const LayerRows& rows) -> Result<void> {
    const auto w0 = Clock::now();
    xdna::ScatterBatch batch;
    batch.layers.push_back({rows.il, rows.rows.data(), rows.n_embd_k_gqa, rows.n_embd_v_gqa});
    batch.pos0 = static_cast<uint32_t>(rows.pos0);
    batch.n_tokens = rows.n_tokens;
    batch.src_type = layout::GgmlType::F32;
    batch.row_stride = (rows.n_embd_k_gqa + rows.n_embd_v_gqa) * sizeof(float);
    batch.rotation_disabled = rotation_disabled;
    batch.n_threads = impl_->n_threads > 0 ? static_cast<unsigned>(impl_->n_threads) : 0;
    if (auto scattered = xdna::scatter(target, batch); !scattered) return scattered;
    // One message per tensor per batch (per element row of a transposed V): a layer's
    // rows go as a few large writes, never a descriptor per token.
    const uint32_t cell_begin = batch.pos0, cell_end = batch.pos0 + batch.n_tokens;
    for (const layout::ChunkRange& r : layout::cell_ranges(share_layout, memory, rows.il, cell_begin, cell_end)) {
      auto sent = (*sender)->write({offer.share_id, r.chunk, r.offset, r.size_bytes},
                                   staging_spans[r.chunk].subspan(r.offset, r.size_bytes));
      if (!sent) return sent;
    }
    transfer_ms += ms_since(w0);
    if (Clock::now() > deadline) return fail(ETIMEDOUT, "the offer's deadline passed during the prefill");
    return {};
  });
  if (!ok) return fail(ok.error().with_context("remote route"));
  const auto f0 = Clock::now();
  if (auto flushed = (*sender)->flush(deadline); !flushed) return fail(flushed.error().with_context("remote route"));
  const layout::RemoteDone done{offer.share_id, n, (*sender)->bytes_sent(), offer.layout_hash};
  if (auto finished = (*sender)->finish(done, deadline); !finished)
    return fail(finished.error().with_context("remote route"));
  transfer_ms += ms_since(f0);
  RemotePrefillReport report;
  report.n_tokens = n;
  report.prefill_ms = ms_since(t0);
  report.transfer_ms = transfer_ms;
  report.forward_ms = report.prefill_ms - transfer_ms;
  report.bytes_sent = done.bytes;
  return report;
}

}  // namespace kvshare::refmodel
