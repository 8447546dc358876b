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

// docs/layout.md's worked example: 2 layers, 2 KV heads of 64.
inline MetadataBuilder worked_example_model() {
  auto builder = transformer("llama", 2, 256, 4, 2, 4096);
  builder.u32("attention.key_length", 64).u32("attention.value_length", 64);
  return builder;
}

// The models `kvshare-mkmodel --arch <arch>` writes with its default options
// (refmodel/generator_*.cc, docs/refmodel.md): the model keys, as the generator writes
// them, without the tokenizer keys (layout reads only their count: 134 tokens). Built here
// so layout tests need neither the generator nor a GGUF file.
inline constexpr uint32_t kMkmodelVocab = 134;

inline MetadataBuilder mkmodel_common(const std::string& arch, uint32_t n_layer) {
  MetadataBuilder builder(arch);
  builder.u32("block_count", n_layer).u32("context_length", 4096).u32("embedding_length", 128);
  return builder;
}

// Recurrent: 2 Mamba-2 layers, d_inner 2 x 128, d_state 16, 4 heads, 1 group, d_conv 4.
inline MetadataBuilder mkmodel_mamba2() {
  auto builder = mkmodel_common("mamba2", 2);
  builder.u32("ssm.conv_kernel", 4)
      .u32("ssm.inner_size", 256)
      .u32("ssm.state_size", 16)
      .u32("ssm.time_step_rank", 4)
      .u32("ssm.group_count", 1)
      .set("attention.layer_norm_rms_epsilon", GgufValue{1e-5f});
  return builder;
}

// iSWA: 2 layers, 4 heads, 2 KV heads of 64; window 32, pattern 2 (layer 0 SWA, layer 1 full).
inline MetadataBuilder mkmodel_gemma3() {
  auto builder = mkmodel_common("gemma3", 2);
  builder.u32("feed_forward_length", 256)
      .u32("attention.head_count", 4)
      .u32("attention.head_count_kv", 2)
      .u32("attention.key_length", 64)
      .u32("attention.value_length", 64)
      .u32("rope.dimension_count", 64)
      .set("attention.layer_norm_rms_epsilon", GgufValue{1e-6f})
      .set("rope.freq_base", GgufValue{1000000.0f})
      .set("rope.freq_base_swa", GgufValue{10000.0f})
      .u32("attention.sliding_window", 32)
      .u32("attention.sliding_window_pattern", 2);
  return builder;
}

// Hybrid with M-RoPE: 4 layers, full_attention_interval 4 (layers 0-2 Gated DeltaNet, layer
// 3 attention with 2 KV heads of 64); GDN 2 key heads and 4 value heads of 16, d_conv 4.
inline MetadataBuilder mkmodel_qwen35() {
  auto builder = mkmodel_common("qwen35", 4);
  builder.u32("feed_forward_length", 256)
      .u32("attention.head_count", 4)
      .u32("attention.head_count_kv", 2)
      .u32("attention.key_length", 64)
      .u32("attention.value_length", 64)
      .u32("rope.dimension_count", 32)
      .set("rope.dimension_sections", u32_array({6, 5, 5, 0}))
      .set("rope.freq_base", GgufValue{10000000.0f})
      .set("attention.layer_norm_rms_epsilon", GgufValue{1e-6f})
      .u32("ssm.conv_kernel", 4)
      .u32("ssm.inner_size", 64)
      .u32("ssm.state_size", 16)
      .u32("ssm.time_step_rank", 4)
      .u32("ssm.group_count", 2)
      .u32("full_attention_interval", 4);
  return builder;
}

// Hybrid with a zero-width S: 2 layers, layer 0 short conv (head_count_kv 0, l_cache 4),
// layer 1 attention with 2 KV heads of 128 / 4 = 32.
inline MetadataBuilder mkmodel_lfm2() {
  auto builder = mkmodel_common("lfm2", 2);
  builder.u32("feed_forward_length", 256)
      .u32("attention.head_count", 4)
      .set("attention.head_count_kv", u32_array({0, 2}))
      .u32("shortconv.l_cache", 4)
      .set("attention.layer_norm_rms_epsilon", GgufValue{1e-5f})
      .set("rope.freq_base", GgufValue{1000000.0f});
  return builder;
}

}  // namespace kvshare::layout::testing
