// A provider's own KV cache, sized for the prompt only: the provider's Context attends
// over it while each layer's rows go to a sink that places them in the real destination
// (a state file, the decoder's shared region, or a remote decoder). One implementation
// for the file, shared and remote routes.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "layout/error.h"
#include "layout/kv_params.h"
#include "refmodel/engine.h"
#include "xdna/scatter.h"

namespace kvshare::refmodel {

struct PrivateKv {
  std::vector<std::vector<std::byte>> buffers;
  KvMemory kv;
};

// A cache of `params` types with room for `n_tokens` (rounded up to 256 cells).
Result<std::unique_ptr<PrivateKv>> make_private_kv(const Model& model, layout::KvParams params, uint32_t n_tokens);

// The model's n_embd_head_k / n_embd_head_v (xdna::ScatterTarget needs them to rotate).
uint32_t head_k(const Model& model);
uint32_t head_v(const Model& model);

// One layer's f32 rows from the prefill, as the scatter batch every route's sink places
// (`n_threads` <= 0: the scatter's default).
xdna::ScatterBatch scatter_batch_of(const LayerRows& rows, bool rotation_disabled, int n_threads);

}  // namespace kvshare::refmodel
