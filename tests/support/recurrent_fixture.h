// Recurrent and hybrid memories for the provider tests, derived from GGUF metadata the way
// a decoder derives them (layout::derive_model_shape, derive_memory_shape): small enough
// that a whole region fits in one chunk of a few pages.
#pragma once

#include <gtest/gtest.h>

#include "layout/memory_shape.h"
#include "layout/model_shape.h"
#include "layout/shape_fixtures.h"

namespace kvshare::testing {

inline layout::MemoryShape memory_of(const layout::testing::MetadataBuilder& builder, uint32_t n_seq_max) {
  auto model = layout::derive_model_shape(builder.metadata());
  EXPECT_TRUE(model) << model.error().what();
  layout::KvParams params;
  params.n_ctx = 256;
  params.n_seq_max = n_seq_max;
  auto memory = layout::derive_memory_shape(model ? *model : layout::ModelShape{}, params);
  EXPECT_TRUE(memory) << memory.error().what();
  return memory ? *memory : layout::MemoryShape{};
}

// Two Mamba-2 layers with n_seq_max cells: n_embd_r = (4 - 1) * (128 + 2 * 1 * 16) = 480,
// n_embd_s = 16 * 128 = 2048.
inline layout::MemoryShape mamba2_memory(uint32_t n_seq_max = 3) {
  layout::testing::MetadataBuilder builder("mamba2");
  builder.u32("block_count", 2)
      .u32("context_length", 4096)
      .u32("embedding_length", 64)
      .u32("ssm.conv_kernel", 4)
      .u32("ssm.inner_size", 128)
      .u32("ssm.state_size", 16)
      .u32("ssm.time_step_rank", 4)
      .u32("ssm.group_count", 1);
  return memory_of(builder, n_seq_max);
}

// LFM2, one cell: layers 0 and 2 are short convolutions (n_embd_r = 64 * (3 - 1) = 128,
// n_embd_s = 0), layers 1 and 3 attention.
inline layout::MemoryShape lfm2_memory() {
  auto builder = layout::testing::transformer("lfm2", 4, 64, 4, 2);
  builder.set("attention.head_count_kv", layout::testing::u32_array({0, 2, 0, 2})).u32("shortconv.l_cache", 3);
  return memory_of(builder, 1);
}

}  // namespace kvshare::testing
