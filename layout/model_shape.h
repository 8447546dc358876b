// The memory shape llama.cpp gives a model, derived from its hyperparameters alone
// (model_hparams.h): llama_hparams' per-layer widths and create_memory's layer filters
// (commit d32676d).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "layout/error.h"
#include "layout/gguf_value.h"
#include "layout/model_hparams.h"

namespace kvshare::layout {

struct LayerShape {
  uint32_t n_head = 0;
  uint32_t n_head_kv = 0;
  uint32_t n_embd_head_k = 0;  // key_length (or key_length_swa on SWA layers)
  uint32_t n_embd_head_v = 0;
  uint32_t n_embd_k_gqa = 0;  // n_embd_head_k * n_head_kv
  uint32_t n_embd_v_gqa = 0;  // n_embd_head_v * n_head_kv
  uint32_t n_ff = 0;
  bool is_swa = false;
  bool is_recurrent = false;
  bool has_kv = true;     // owns K/V tensors (false past n_layer_kv_from_start)
  bool is_nextn = false;  // an MTP/NextN block past the trunk
};

struct ModelShape {
  std::string arch;          // general.architecture
  uint32_t n_layer_all = 0;  // {arch}.block_count, trunk + NextN
  uint32_t n_layer_nextn = 0;
  uint32_t n_layer = 0;  // trunk: n_layer_all - n_layer_nextn
  uint32_t n_embd = 0;
  uint32_t n_ctx_train = 0;
  std::vector<LayerShape> layers;  // [n_layer_all]

  uint32_t n_swa = 0;
  SwaType swa_type = SwaType::none;
  bool is_mla = false;          // K only (latent), no V tensor
  uint32_t n_pos_per_embd = 1;  // 4 for M-RoPE: state-file cells grow by 8 bytes

  // Recurrent state widths, elements per sequence per recurrent layer (f32).
  uint32_t n_embd_r = 0;
  uint32_t n_embd_s = 0;

  MemoryKind memory_kind = MemoryKind::kv;
};

// Derives the shape from the model's hyperparameters (read_model_hparams). Fails when a
// KV-cache model has no attention heads, or a width overflows 32 bits, naming the key or
// the width.
Result<ModelShape> model_shape_from_hparams(const ModelHparams& hparams);

// read_model_hparams then model_shape_from_hparams, for callers that have only the
// metadata: errors name the key; the caller adds the file.
Result<ModelShape> derive_model_shape(const GgufMetadata& metadata);

}  // namespace kvshare::layout
