#include "apps/provider/private_kv.h"

#include <algorithm>

#include "layout/memory_shape.h"
#include "layout/share_layout.h"
#include "refmodel/model_impl.h"

namespace kvshare::refmodel {

Result<std::unique_ptr<PrivateKv>> make_private_kv(const Model& model, layout::KvParams params, uint32_t n_tokens) {
  params.n_ctx = std::max<uint32_t>(256, (n_tokens + 255) / 256 * 256);
  params.n_seq_max = 1;
  auto memory = layout::derive_memory_shape(model.shape(), params);
  if (!memory) return fail(memory.error().with_context("sizing the provider's own KV cache"));
  auto out = std::make_unique<PrivateKv>();
  out->kv.memory = std::move(*memory);
  out->kv.layout = layout::share_layout(out->kv.memory);
  for (const auto& chunk : out->kv.layout.chunks) {
    out->buffers.push_back(std::make_unique_for_overwrite<std::byte[]>(chunk.size_bytes));
    out->kv.chunks.emplace_back(out->buffers.back().get(), chunk.size_bytes);
  }
  return out;
}

Result<Context*> PrivateContext::get(const std::shared_ptr<const Model>& model, const layout::KvParams& params,
                                     uint32_t n_tokens, int n_threads) {
  // n_ctx and n_seq_max are the decoder's; the private cache holds one sequence of the prompt.
  const auto types_of = [](layout::KvParams p) {
    p.n_ctx = 0;
    p.n_seq_max = 1;
    return p;
  };
  if (ctx_ && model_ == model && types_of(params_) == types_of(params) && n_threads_ == n_threads &&
      n_tokens <= n_cells())
    return ctx_.get();
  ctx_.reset();
  kv_.reset();
  auto kv = make_private_kv(*model, params, n_tokens);
  if (!kv) return fail(kv.error());
  auto ctx = Context::create(model, (*kv)->kv, n_threads);
  if (!ctx) return fail(ctx.error());
  model_ = model;
  params_ = params;
  n_threads_ = n_threads;
  kv_ = std::move(*kv);
  ctx_ = std::move(*ctx);
  return ctx_.get();
}

uint32_t PrivateContext::n_cells() const {
  if (!ctx_) return 0;
  return static_cast<uint32_t>(ctx_->n_ctx());
}

uint32_t head_k(const Model& model) { return static_cast<const LoadedModel&>(model).hparams().n_embd_head_k; }
uint32_t head_v(const Model& model) { return static_cast<const LoadedModel&>(model).hparams().n_embd_head_v; }

kvshare::ScatterBatch scatter_batch_of(const LayerRows& rows, bool rotation_disabled, int n_threads) {
  kvshare::ScatterBatch batch;
  batch.layers.push_back({rows.il, rows.rows.data(), rows.n_embd_k_gqa, rows.n_embd_v_gqa});
  batch.pos0 = static_cast<uint32_t>(rows.pos0);
  batch.n_tokens = rows.n_tokens;
  batch.src_type = layout::GgmlType::F32;
  batch.row_stride = (rows.n_embd_k_gqa + rows.n_embd_v_gqa) * sizeof(float);
  batch.rotation_disabled = rotation_disabled;
  batch.n_threads = n_threads > 0 ? static_cast<unsigned>(n_threads) : 0;
  return batch;
}

}  // namespace kvshare::refmodel
