// Per-architecture hyperparameter rules behind read_model_hparams: the part of each
// llama.cpp load_arch_hparams (src/models/<arch>.cpp) that changes the memory shape.
// Internal to layout/; callers use model_hparams.h.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "layout/error.h"
#include "layout/gguf_value.h"
#include "layout/model_hparams.h"

namespace kvshare::layout::detail {

// Reads "{arch}.<suffix>" keys with llama.cpp's strict types.
class ArchKeys {
 public:
  ArchKeys(const GgufMetadata& metadata, std::string arch) : metadata_(metadata), arch_(std::move(arch)) {}
  std::string key(HparamKey which) const { return arch_ + "." + std::string(hparam_key_suffix(which)); }
  const std::string& arch() const { return arch_; }

  const GgufValue* find(HparamKey which) const { return metadata_.find(key(which)); }
  Result<uint32_t> u32(HparamKey which) const { return metadata_.get_u32(key(which)); }
  Result<std::optional<uint32_t>> find_u32(HparamKey which) const { return metadata_.find_u32(key(which)); }
  Result<std::optional<float>> find_f32(HparamKey which) const { return metadata_.find_f32(key(which)); }
  // Absent keys leave `value` as it is (llama.cpp's get_key(..., required = false)).
  Result<void> read_optional(HparamKey which, uint32_t& value) const;
  Result<void> read_optional(HparamKey which, float& value) const;
  Result<void> read_optional(HparamKey which, std::string& value) const;
  Result<std::optional<std::vector<uint32_t>>> per_layer(HparamKey which, uint32_t n) const {
    return metadata_.find_per_layer(key(which), n);
  }

 private:
  const GgufMetadata& metadata_;
  std::string arch_;
};

using ArchRule = Result<void> (*)(const ArchKeys& keys, ModelHparams& hparams);

struct ArchEntry {
  std::string_view name;
  ArchRule rule;
};

// Every supported arch with its rule, in a stable order.
const std::vector<ArchEntry>& arch_table();

}  // namespace kvshare::layout::detail
