// The Qwen3-Coder-30B-A3B cache shape the handoff benches price (qwen3moe: 48 layers,
// 4 KV heads x 128, f16, flash attention on), as the share header a decoder would send.
#pragma once

#include <stdexcept>
#include <string>

#include "layout/share_header.h"

namespace kvshare::bench {

inline layout::ShareHeader qwen3_coder_header(uint32_t n_ctx) {
  using layout::GgufValue;
  layout::GgufMetadata metadata;
  metadata.set("general.architecture", GgufValue{std::string("qwen3moe")});
  auto u32 = [&](const char* key, uint32_t value) { metadata.set(std::string("qwen3moe.") + key, GgufValue{value}); };
  u32("block_count", 48);
  u32("context_length", 262144);
  u32("embedding_length", 2048);
  u32("feed_forward_length", 8192);
  u32("attention.head_count", 32);
  u32("attention.head_count_kv", 4);
  u32("attention.key_length", 128);
  u32("attention.value_length", 128);
  auto shape = layout::derive_model_shape(metadata);
  if (!shape) throw std::runtime_error(shape.error().what());
  layout::KvParams params;
  params.n_ctx = n_ctx;
  layout::ModelFingerprint model{"qwen3moe", "Qwen3-Coder-30B-A3B shape", 48, 2048, 151936, 0x30b0a3b0ull};
  auto header = layout::make_share_header(model, *shape, params);
  if (!header) throw std::runtime_error(header.error().what());
  return *header;
}

}  // namespace kvshare::bench
