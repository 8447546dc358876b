// A provider's own KV cache, sized for the prompt only: the provider's Context attends
// over it while each layer's rows go to a sink that places them in the real destination
// (a state file, the decoder's shared region, or a remote decoder). One implementation
// for the file, shared and remote routes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kvshare/scatter/scatter.h"
#include "layout/error.h"
#include "layout/kv_params.h"
#include "refmodel/engine.h"

namespace kvshare::refmodel {

struct PrivateKv {
  // Not zeroed: a Context stores every cell before it attends over it, and no sink reads
  // the cache. Zeroing faulted the whole cache in before the prefill began (docs/refmodel.md,
  // "The resident form" has the cost); now the prefill's own stores touch the prompt's cells.
  std::vector<std::unique_ptr<std::byte[]>> buffers;
  KvMemory kv;
};

// A cache of `params` types with room for `n_tokens` (rounded up to 256 cells).
Result<std::unique_ptr<PrivateKv>> make_private_kv(const Model& model, layout::KvParams params, uint32_t n_tokens);

// A provider's own cache and the Context over it, kept from one prefill to the next. A
// resident provider keeps one, so its cache and the Context's working memory (attention
// scores, the cache read back as f32, the activations of the whole prompt) are allocated
// and faulted in once and then reused, where a per-request provider allocates, faults in
// and unmaps them on every prompt. It holds the memory of the longest prompt so far until
// it is destroyed. What an earlier, longer prompt left in its cells never reaches a
// result: a prefill from position 0 stores each layer's cells 0..N-1 before it attends
// over them, and attends over no other cell.
class PrivateContext {
 public:
  // A Context over a private cache of `params`' types (n_ctx and n_seq_max aside) holding
  // at least `n_tokens` cells, for a prefill from position 0: the kept one when it is of
  // `model`, `params` and `n_threads` and has the room, else a new one, made after the old
  // one is freed so that both never count against memory at once. The Context is this
  // object's, valid until the next call. Fails as make_private_kv and Context::create do.
  Result<Context*> get(const std::shared_ptr<const Model>& model, const layout::KvParams& params, uint32_t n_tokens,
                       int n_threads);

  // Cells of the kept cache, 0 when none is kept.
  uint32_t n_cells() const;

 private:
  std::shared_ptr<const Model> model_;
  layout::KvParams params_;  // as given, n_ctx and n_seq_max aside
  int n_threads_ = 0;
  std::unique_ptr<PrivateKv> kv_;
  std::unique_ptr<Context> ctx_;  // over kv_
};

// The model's n_embd_head_k / n_embd_head_v (kvshare::ScatterTarget needs them to rotate).
uint32_t head_k(const Model& model);
uint32_t head_v(const Model& model);

// One layer's f32 rows from the prefill, as the scatter batch every route's sink places
// (`n_threads` <= 0: the scatter's default).
kvshare::ScatterBatch scatter_batch_of(const LayerRows& rows, bool rotation_disabled, int n_threads);

}  // namespace kvshare::refmodel
