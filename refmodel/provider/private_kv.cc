#include "refmodel/provider/private_kv.h"

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
  for (const auto& chunk : out->kv.layout.chunks) out->buffers.emplace_back(chunk.size_bytes);
  for (auto& b : out->buffers) out->kv.chunks.emplace_back(b);
  return out;
}

uint32_t head_k(const Model& model) { return static_cast<const LoadedModel&>(model).hparams().n_embd_head_k; }
uint32_t head_v(const Model& model) { return static_cast<const LoadedModel&>(model).hparams().n_embd_head_v; }

xdna::ScatterBatch scatter_batch_of(const LayerRows& rows, bool rotation_disabled, int n_threads) {
  xdna::ScatterBatch batch;
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
