// Per-architecture hyperparameter rules behind derive_model_shape: the part of each
// llama.cpp load_arch_hparams (src/models/<arch>.cpp) that changes the memory shape.
// Internal to layout/; callers use model_shape.h.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "layout/error.h"
#include "layout/gguf_value.h"
#include "layout/model_shape.h"

namespace kvshare::layout::detail {

// Reads "{arch}.<suffix>" keys with llama.cpp's strict types.
class ArchKeys {
 public:
  ArchKeys(const GgufMetadata& metadata, std::string arch) : metadata_(metadata), arch_(std::move(arch)) {}
  std::string key(std::string_view suffix) const { return arch_ + "." + std::string(suffix); }
  const GgufMetadata& metadata() const { return metadata_; }
  const std::string& arch() const { return arch_; }

  Result<uint32_t> u32(std::string_view suffix) const { return metadata_.get_u32(key(suffix)); }
  Result<std::optional<uint32_t>> find_u32(std::string_view suffix) const { return metadata_.find_u32(key(suffix)); }
  // Absent keys leave `value` as it is (llama.cpp's get_key(..., required = false)).
  Result<void> read_optional(std::string_view suffix, uint32_t& value) const;
  Result<std::optional<std::vector<uint32_t>>> per_layer(std::string_view suffix, uint32_t n) const {
    return metadata_.find_per_layer(key(suffix), n);
  }

 private:
  const GgufMetadata& metadata_;
  std::string arch_;
};

// llama_hparams while it is being filled: what load_hparams read, before the arch rules
// and the per-layer widths are applied.
struct HparamsDraft {
  uint32_t n_layer_all = 0;
  uint32_t n_layer_nextn = 0;
  uint32_t n_embd = 0;
  uint32_t n_ctx_train = 0;
  std::vector<uint32_t> n_head;     // [n_layer_all]
  std::vector<uint32_t> n_head_kv;  // [n_layer_all]
  std::vector<uint32_t> n_ff;       // [n_layer_all]
  uint32_t n_embd_head_k_full = 0;
  uint32_t n_embd_head_v_full = 0;
  uint32_t n_embd_head_k_swa = 0;
  uint32_t n_embd_head_v_swa = 0;
  std::vector<bool> is_swa;   // [n_layer_all]
  std::vector<bool> is_recr;  // [n_layer_all]
  uint32_t n_swa = 0;
  SwaType swa_type = SwaType::none;
  uint32_t n_embd_head_k_mla = 0;
  uint32_t n_embd_head_v_mla = 0;
  uint32_t ssm_d_conv = 0;
  uint32_t ssm_d_inner = 0;
  uint32_t ssm_d_state = 0;
  uint32_t ssm_n_group = 0;
  uint32_t n_shortconv_l_cache = 0;  // LFM2: conv state of l_cache - 1 columns, no ssm state
  uint32_t n_pos_per_embd = 1;
  MemoryKind memory_kind = MemoryKind::kv;
  // Hybrid Qwen3-Next/3.5: NextN blocks are in neither cache of the main context
  // (create_memory's filter_attn and filter_recr both require il < n_layer()).
  bool nextn_in_attention_cache = true;

  uint32_t n_layer() const { return n_layer_all - n_layer_nextn; }
  // llama_hparams::set_swa_pattern: trunk layers only, NextN layers never SWA.
  void set_swa_pattern(uint32_t period, bool dense_first = false);
};

using ArchRule = Result<void> (*)(const ArchKeys& keys, HparamsDraft& hparams);

struct ArchEntry {
  std::string_view name;
  ArchRule rule;
};

// Every supported arch with its rule, in a stable order.
const std::vector<ArchEntry>& arch_table();

}  // namespace kvshare::layout::detail
