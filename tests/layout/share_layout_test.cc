#include "layout/share_layout.h"

#include <gtest/gtest.h>

#include "layout/shape_fixtures.h"

namespace kvshare::layout {
namespace {

MemoryShape worked_example_memory(uint32_t n_seq_max, bool unified) {
  auto model = derive_model_shape(testing::worked_example_model().metadata());
  EXPECT_TRUE(model.has_value()) << model.error().what();
  KvParams params;
  params.n_ctx = 512;
  params.n_seq_max = n_seq_max;
  params.kv_unified = unified;
  auto memory = derive_memory_shape(*model, params);
  EXPECT_TRUE(memory.has_value()) << memory.error().what();
  return *memory;
}

// A cache object holding f16 tensors of the given byte sizes (ne[0] = bytes / 2).
MemoryShape cache_of_sizes(const std::vector<uint64_t>& sizes) {
  MemoryShape memory;
  KvCacheShape cache;
  cache.role = "kv";
  for (size_t i = 0; i < sizes.size(); ++i) {
    CacheTensor t;
    t.name = "cache_k_l" + std::to_string(i);
    t.layer = static_cast<uint32_t>(i);
    t.type = GgmlType::F16;
    t.ne = {static_cast<int64_t>(sizes[i] / 2), 1, 1, 1};
    t.nbytes = sizes[i];
    t.row_bytes = sizes[i];
    cache.tensors.push_back(t);
  }
  memory.kv_caches.push_back(cache);
  return memory;
}

constexpr uint64_t kMiB = uint64_t{1} << 20;

TEST(ShareLayout, ReproducesTheSpecsWorkedExample) {
  const ShareLayout layout = share_layout(worked_example_memory(1, true));
  ASSERT_EQ(layout.chunks.size(), 1u);
  EXPECT_EQ(layout.chunks[0].size_bytes, 524288u);
  EXPECT_EQ(layout.chunks[0].layout_hash, 0xc152419dd99b2d2full);
  EXPECT_EQ(layout.total_bytes(), 524288u);
  ASSERT_EQ(layout.tensors.size(), 4u);
  const uint64_t offsets[] = {0, 131072, 262144, 393216};
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(layout.tensors[i].chunk, 0u);
    EXPECT_EQ(layout.tensors[i].offset, offsets[i]);
    EXPECT_EQ(layout.tensors[i].padded_bytes, 131072u);
  }
}

TEST(ShareLayout, HashesTypeAndShapeAsWholeWordsTensorByTensor) {
  const MemoryShape memory = worked_example_memory(1, true);
  // docs/layout.md's running values after each tensor of the worked example.
  const uint64_t expected[] = {0xbd59b378fd6c1e3cull, 0x05b423ba98441fa1ull, 0x0012c5b70ef7bdd6ull,
                               0xc152419dd99b2d2full};
  uint64_t hash = kLayoutHashSeed;
  for (size_t i = 0; i < 4; ++i) {
    hash = layout_hash_step(hash, memory.kv_caches[0].tensors[i]);
    EXPECT_EQ(hash, expected[i]) << "after tensor " << i;
  }
}

// Regression: the start value is decimal 1469598103934665603, not FNV-1a's textbook
// 0xcbf29ce484222325; only the former reproduces the worked example's hash values.
TEST(ShareLayout, SeedsWithTheForksDecimalLiteral) { EXPECT_EQ(kLayoutHashSeed, 0x14650fb0739d0383ull); }

TEST(ShareLayout, ReproducesTheSpecsTwoStreamVariant) {
  const ShareLayout layout = share_layout(worked_example_memory(2, false));
  ASSERT_EQ(layout.chunks.size(), 1u);
  EXPECT_EQ(layout.chunks[0].size_bytes, 524288u);
  EXPECT_EQ(layout.chunks[0].layout_hash, 0x1f38a97419886623ull);
  EXPECT_EQ(layout.tensors[3].offset, 393216u);
}

TEST(ShareLayout, StartsEveryTensorOnA4KiBBoundary) {
  const ShareLayout layout = share_layout(cache_of_sizes({1000, 6000, 2}));
  ASSERT_EQ(layout.tensors.size(), 3u);
  EXPECT_EQ(layout.tensors[0].offset, 0u);
  EXPECT_EQ(layout.tensors[0].padded_bytes, 4096u);
  EXPECT_EQ(layout.tensors[1].offset, 4096u);
  EXPECT_EQ(layout.tensors[1].padded_bytes, 8192u);
  EXPECT_EQ(layout.tensors[2].offset, 12288u);
  EXPECT_EQ(layout.chunks[0].size_bytes, 16384u);
}

TEST(ShareLayout, FillsAChunkUpToExactlyOneGiBThenStartsTheNext) {
  const ShareLayout layout = share_layout(cache_of_sizes({512 * kMiB, 512 * kMiB, 512 * kMiB}));
  ASSERT_EQ(layout.chunks.size(), 2u);
  EXPECT_EQ(layout.chunks[0].size_bytes, kShareChunkMax);
  EXPECT_EQ(layout.chunks[1].size_bytes, 512 * kMiB);
  EXPECT_EQ(layout.tensors[1].chunk, 0u);
  EXPECT_EQ(layout.tensors[1].offset, 512 * kMiB);
  EXPECT_EQ(layout.tensors[2].chunk, 1u);
  EXPECT_EQ(layout.tensors[2].offset, 0u);  // offsets restart in every chunk
}

TEST(ShareLayout, SeedsEachChunksHashAfresh) {
  const MemoryShape memory = cache_of_sizes({512 * kMiB, 512 * kMiB, 512 * kMiB});
  const ShareLayout layout = share_layout(memory);
  const auto& tensors = memory.kv_caches[0].tensors;
  EXPECT_EQ(layout.chunks[0].layout_hash, layout_hash_step(layout_hash_step(kLayoutHashSeed, tensors[0]), tensors[1]));
  EXPECT_EQ(layout.chunks[1].layout_hash, layout_hash_step(kLayoutHashSeed, tensors[2]));
}

TEST(ShareLayout, GivesATensorAboveOneGiBAChunkOfItsOwn) {
  const uint64_t big = 1536 * kMiB;
  const ShareLayout layout = share_layout(cache_of_sizes({4096, big, 4096}));
  ASSERT_EQ(layout.chunks.size(), 3u);
  EXPECT_EQ(layout.chunks[0].size_bytes, 4096u);
  EXPECT_EQ(layout.chunks[1].size_bytes, big);
  EXPECT_EQ(layout.chunks[2].size_bytes, 4096u);
  EXPECT_EQ(layout.tensors[1].chunk, 1u);
  EXPECT_EQ(layout.tensors[1].offset, 0u);
  EXPECT_EQ(layout.tensors[2].chunk, 2u);
}

TEST(ShareLayout, KeepsALoneHugeFirstTensorInTheFirstChunk) {
  const ShareLayout layout = share_layout(cache_of_sizes({2048 * kMiB}));
  ASSERT_EQ(layout.chunks.size(), 1u);
  EXPECT_EQ(layout.chunks[0].size_bytes, 2048 * kMiB);
}

TEST(ShareLayout, RaisesAChunkOfEmptyTensorsTo4KiB) {
  const ShareLayout layout = share_layout(cache_of_sizes({0}));
  ASSERT_EQ(layout.chunks.size(), 1u);
  EXPECT_EQ(layout.chunks[0].size_bytes, 4096u);
}

TEST(ShareLayout, ChunksEachCacheObjectSeparatelyInFdOrder) {
  auto model =
      derive_model_shape(testing::transformer("gemma3", 6, 1024, 4, 1).u32("attention.sliding_window", 512).metadata());
  ASSERT_TRUE(model.has_value()) << model.error().what();
  KvParams params;
  params.n_ctx = 4096;
  auto memory = derive_memory_shape(*model, params);
  ASSERT_TRUE(memory.has_value());
  const ShareLayout layout = share_layout(*memory);
  ASSERT_EQ(layout.chunks.size(), 2u);
  EXPECT_EQ(layout.chunks[0].cache_index, 0u);
  EXPECT_EQ(layout.chunks[1].cache_index, 1u);
  const SharedTensor* full_k = layout.find(0, 5, TensorKind::k);
  ASSERT_NE(full_k, nullptr);
  EXPECT_EQ(full_k->offset, 0u);
  const SharedTensor* swa_v = layout.find("cache_v_l1");
  ASSERT_NE(swa_v, nullptr);
  EXPECT_EQ(swa_v->cache_index, 1u);
  EXPECT_EQ(swa_v->chunk, 1u);
  EXPECT_EQ(layout.find(0, 1, TensorKind::k), nullptr);
  EXPECT_EQ(layout.find("cache_k_l9"), nullptr);
}

TEST(ShareLayout, PlacesRecurrentStateAfterTheKvCaches) {
  testing::MetadataBuilder builder("mamba2");
  builder.u32("block_count", 1)
      .u32("context_length", 4096)
      .u32("embedding_length", 768)
      .u32("ssm.conv_kernel", 4)
      .u32("ssm.inner_size", 1536)
      .u32("ssm.state_size", 128)
      .u32("ssm.time_step_rank", 24)
      .u32("ssm.group_count", 1);
  auto model = derive_model_shape(builder.metadata());
  ASSERT_TRUE(model.has_value()) << model.error().what();
  auto memory = derive_memory_shape(*model, KvParams{});
  ASSERT_TRUE(memory.has_value());
  const ShareLayout layout = share_layout(*memory);
  ASSERT_EQ(layout.chunks.size(), 1u);
  EXPECT_EQ(layout.chunks[0].cache_index, 0u);  // kv_caches is empty: index 0 is the recurrent state
  ASSERT_EQ(layout.tensors.size(), 2u);
  EXPECT_EQ(layout.tensors[0].tensor.name, "cache_r_l0");
  EXPECT_EQ(layout.tensors[0].padded_bytes, 24576u);  // 5376 * 4 = 21504 -> 24576
  EXPECT_EQ(layout.tensors[1].offset, 24576u);
}

}  // namespace
}  // namespace kvshare::layout
