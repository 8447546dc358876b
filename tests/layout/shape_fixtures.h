// In-memory GGUF metadata for the shape tests: the keys a converter writes for a model,
// without any file.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "layout/gguf_value.h"
#include "layout/model_shape.h"

namespace kvshare::layout::testing {

inline GgufValue u32_value(uint32_t value) { return GgufValue{value}; }
inline GgufValue string_value(std::string value) { return GgufValue{std::move(value)}; }

inline GgufValue u32_array(const std::vector<uint32_t>& values) {
  GgufArray array;
  array.element_type = GgufValueType::UINT32;
  for (uint32_t v : values) array.elements.push_back(GgufValue{v});
  return GgufValue{std::move(array)};
}

inline GgufValue i32_array(const std::vector<int32_t>& values) {
  GgufArray array;
  array.element_type = GgufValueType::INT32;
  for (int32_t v : values) array.elements.push_back(GgufValue{v});
  return GgufValue{std::move(array)};
}

inline GgufValue bool_array(const std::vector<bool>& values) {
  GgufArray array;
  array.element_type = GgufValueType::BOOL;
  for (bool v : values) array.elements.push_back(GgufValue{v});
  return GgufValue{std::move(array)};
}

// A builder that prefixes keys with the arch, as converters do.
class MetadataBuilder {
 public:
  explicit MetadataBuilder(std::string arch) : arch_(std::move(arch)) {
    metadata_.set("general.architecture", string_value(arch_));
  }
  MetadataBuilder& set(const std::string& suffix, GgufValue value) {
    metadata_.set(arch_ + "." + suffix, std::move(value));
    return *this;
  }
  MetadataBuilder& u32(const std::string& suffix, uint32_t value) { return set(suffix, u32_value(value)); }
  MetadataBuilder& remove_by_rebuilding(const std::string& suffix) {
    GgufMetadata rebuilt;
    for (const auto& [key, value] : metadata_.entries())
      if (key != arch_ + "." + suffix) rebuilt.set(key, value);
    metadata_ = std::move(rebuilt);
    return *this;
  }
  const GgufMetadata& metadata() const { return metadata_; }

 private:
  std::string arch_;
  GgufMetadata metadata_;
};

// The common transformer keys: block_count, context_length, embedding_length, heads.
inline MetadataBuilder transformer(const std::string& arch, uint32_t n_layer, uint32_t n_embd, uint32_t n_head,
                                   uint32_t n_head_kv, uint32_t n_ctx_train = 32768) {
  MetadataBuilder builder(arch);
  builder.u32("block_count", n_layer)
      .u32("context_length", n_ctx_train)
      .u32("embedding_length", n_embd)
      .u32("feed_forward_length", 4 * n_embd)
      .u32("attention.head_count", n_head)
      .u32("attention.head_count_kv", n_head_kv);
  return builder;
}

// Qwen3-Coder-30B-A3B's shape: qwen3moe, 48 layers, n_embd 2048, 32 heads, 4 KV heads of 128.
inline MetadataBuilder qwen3_coder_30b() {
  auto builder = transformer("qwen3moe", 48, 2048, 32, 4, 262144);
  builder.u32("attention.key_length", 128).u32("attention.value_length", 128);
  return builder;
}

// The spec's worked example: 2 layers, 2 KV heads of 64.
inline MetadataBuilder worked_example_model() {
  auto builder = transformer("llama", 2, 256, 4, 2, 4096);
  builder.u32("attention.key_length", 64).u32("attention.value_length", 64);
  return builder;
}

}  // namespace kvshare::layout::testing
