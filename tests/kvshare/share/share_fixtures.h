// A real (small) layout header for the share tests and the child provider: a 2-layer
// llama-shaped model through derive_model_shape and make_share_header, so the header
// survives parse_share_header and check_compatible like a real one.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>

#include "layout/share_header.h"

namespace kvshare::testing {

inline layout::ShareHeader small_share_header(uint32_t n_ctx = 256, layout::GgmlType type_k = layout::GgmlType::F16,
                                              uint32_t n_layer = 2, uint32_t n_seq_max = 1, bool kv_unified = true) {
  using layout::GgufValue;
  layout::GgufMetadata metadata;
  metadata.set("general.architecture", GgufValue{std::string("llama")});
  metadata.set("llama.block_count", GgufValue{n_layer});
  metadata.set("llama.context_length", GgufValue{uint32_t{4096}});
  metadata.set("llama.embedding_length", GgufValue{uint32_t{256}});
  metadata.set("llama.feed_forward_length", GgufValue{uint32_t{512}});
  metadata.set("llama.attention.head_count", GgufValue{uint32_t{4}});
  metadata.set("llama.attention.head_count_kv", GgufValue{uint32_t{2}});
  auto shape = layout::derive_model_shape(metadata);
  if (!shape) std::abort();
  layout::ModelFingerprint model{"llama", "kvshare zero-copy test", n_layer, 256, 0, 0x5eed5eed5eed5eedull};
  layout::KvParams params;
  params.n_ctx = n_ctx;
  params.type_k = type_k;
  params.n_seq_max = n_seq_max;
  params.kv_unified = kv_unified;
  auto header = layout::make_share_header(model, *shape, params);
  if (!header) std::abort();
  return *header;
}

// llama-server -np 3 without --kv-unified: three streams (slots) of 256 cells each.
inline layout::ShareHeader three_stream_share_header() {
  return small_share_header(768, layout::GgmlType::F16, 2, 3, false);
}

// The byte the child provider writes at (layer, K or V, row, column): distinct per tensor
// and per row, so a misplaced row shows.
inline unsigned char pattern_byte(uint32_t il, bool is_v, uint64_t row, uint64_t column) {
  return static_cast<unsigned char>(1 + ((il * 37 + (is_v ? 101 : 0) + row * 13 + column) % 251));
}

}  // namespace kvshare::testing
