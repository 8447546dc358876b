// The DMA plan, executed by the simulator, must write exactly what kvshare::scatter writes;
// the simulator must refuse every pattern the shim could not run.
#include "xdna/dma_plan.h"

#include <gtest/gtest.h>

#include <random>

#include "support/cache_fixture.h"

namespace kvshare::xdna {
namespace {

using kvshare::testing::CacheSpec;
using kvshare::testing::make_rows;
using kvshare::testing::Region;
using layout::GgmlType;

std::span<std::byte> tensor_bytes(Region& region, const std::string& name) {
  const layout::SharedTensor* placed = region.layout.find(name);
  return {region.tensor(name), placed->tensor.nbytes};
}

ScatterBatch batch_for(const kvshare::testing::ProviderRows& rows, uint32_t il, uint32_t nk, uint32_t nv, GgmlType type,
                       uint32_t pos0, uint32_t n_tokens, uint32_t stream = 0) {
  ScatterBatch batch;
  batch.layers.push_back({il, rows.bytes.data(), nk, nv});
  batch.pos0 = pos0;
  batch.n_tokens = n_tokens;
  batch.stream = stream;
  batch.src_type = type;
  batch.row_stride = rows.row_stride;
  batch.n_threads = 1;
  return batch;
}

TEST(DmaPlan, WritesExactlyWhatTheCpuScatterWritesForRandomShapes) {
  std::mt19937 rng(2024);
  int planned_v = 0, split_tokens = 0, split_rows = 0;
  for (int iteration = 0; iteration < 100; ++iteration) {
    const GgmlType type = rng() % 2 ? GgmlType::F16 : GgmlType::F32;
    const uint32_t nk = 32 * (1 + rng() % (rng() % 4 == 0 ? 80 : 12));
    const uint32_t nv = 32 * (1 + rng() % 12);
    const bool v_trans = rng() % 3 == 0;
    // One shape in five has more than 1023 tokens, which one descriptor cannot cover.
    const bool long_batch = rng() % 5 == 0;
    const uint32_t kv_size = long_batch ? 1200 + rng() % 1300 : 16 + rng() % 300;
    const uint32_t n_stream = 1 + rng() % 2;
    const uint32_t stream = rng() % n_stream;
    const uint32_t pos0 = long_batch ? rng() % 100 : rng() % kv_size;
    const uint32_t n_tokens = long_batch ? 1024 + rng() % (kv_size - pos0 - 1023) : 1 + rng() % (kv_size - pos0);
    const uint64_t pad_bytes = 4 * (rng() % 3);
    CacheSpec spec{{nk}, {nv}, kv_size, n_stream, type, type, v_trans};
    Region by_cpu(spec), by_dma(spec);
    const auto rows = make_rows(n_tokens, nk, nv, type, 100 + static_cast<uint32_t>(iteration), pad_bytes);
    const ScatterBatch batch = batch_for(rows, 0, nk, nv, type, pos0, n_tokens, stream);
    ASSERT_TRUE(scatter(by_cpu.target(), batch));
    auto plan = plan_layer_dma(by_dma.target(), batch);
    ASSERT_TRUE(plan) << plan.error().what();
    ASSERT_TRUE(plan->covers_k) << (plan->cpu_fallback.empty() ? "" : plan->cpu_fallback[0]);
    ASSERT_TRUE(
        simulate_dma(*plan, rows.bytes, tensor_bytes(by_dma, "cache_k_l0"), tensor_bytes(by_dma, "cache_v_l0")));
    const auto k_cpu = tensor_bytes(by_cpu, "cache_k_l0"), k_dma = tensor_bytes(by_dma, "cache_k_l0");
    ASSERT_TRUE(std::equal(k_cpu.begin(), k_cpu.end(), k_dma.begin())) << "iteration " << iteration;
    // A transposed f16 V has no plan: the reason is given and the V tensor is not touched.
    EXPECT_EQ(plan->covers_v, !(v_trans && type == GgmlType::F16)) << iteration;
    if (plan->covers_v) {
      ++planned_v;
      EXPECT_EQ(by_cpu.storage, by_dma.storage) << "iteration " << iteration;
    }
    split_tokens += n_tokens > 1023;
    split_rows += nk * layout::ggml_row_size(type, 1) / 4 > 1023;
  }
  // The random shapes must have exercised both splits and the V plans.
  EXPECT_GT(planned_v, 10);
  EXPECT_GT(split_tokens, 3);
  EXPECT_GT(split_rows, 3);
}

TEST(DmaPlan, LeavesATransposedF16VToTheCpuAndSaysWhy) {
  CacheSpec spec{{64}, {64}, 32, 1, GgmlType::F16, GgmlType::F16, true};
  Region region(spec);
  const auto rows = make_rows(4, 64, 64, GgmlType::F16, 1);
  auto plan = plan_layer_dma(region.target(), batch_for(rows, 0, 64, 64, GgmlType::F16, 0, 4));
  ASSERT_TRUE(plan);
  EXPECT_TRUE(plan->covers_k);
  EXPECT_FALSE(plan->covers_v);
  ASSERT_EQ(plan->cpu_fallback.size(), 1u);
  EXPECT_NE(plan->cpu_fallback[0].find("cache_v_l0: transposed V of 2-byte f16 elements"), std::string::npos)
      << plan->cpu_fallback[0];
}

TEST(DmaPlan, LeavesAConvertingScatterToTheCpu) {
  CacheSpec spec{{64}, {64}, 32};
  Region region(spec);
  const auto rows = make_rows(4, 64, 64, GgmlType::F32, 2);
  auto plan = plan_layer_dma(region.target(), batch_for(rows, 0, 64, 64, GgmlType::F32, 0, 4));
  ASSERT_TRUE(plan);
  EXPECT_FALSE(plan->covers_k);
  EXPECT_TRUE(plan->transfers.empty());
  ASSERT_EQ(plan->cpu_fallback.size(), 2u);
  EXPECT_NE(plan->cpu_fallback[0].find("cannot convert"), std::string::npos);
}

TEST(DmaPlan, SplitsMoreThan1023TokensOverSeveralDescriptors) {
  CacheSpec spec{{64}, {64}, 4096};
  Region region(spec);
  const auto rows = make_rows(2500, 64, 64, GgmlType::F16, 3);
  auto plan = plan_layer_dma(region.target(), batch_for(rows, 0, 64, 64, GgmlType::F16, 10, 2500));
  ASSERT_TRUE(plan);
  // 3 BDs (1023 + 1023 + 454) for K on channel 0 and 3 for V on channel 1.
  ASSERT_EQ(plan->transfers.size(), 6u);
  EXPECT_EQ(plan->transfers[0].read.dims[1].size, 1023u);
  EXPECT_EQ(plan->transfers[2].read.dims[1].size, 454u);
  EXPECT_EQ(plan->transfers[3].channel, 1u);
}

// Regression: a V row that is not whole words was truncated to whole words and the plan
// still claimed to cover V, so the last bytes of every row were never written.
TEST(DmaPlan, LeavesAVRowThatIsNotWholeWordsToTheCpu) {
  CacheSpec spec{{64}, {33}, 32, 1, GgmlType::F16, GgmlType::F16, false};
  Region region(spec);
  const auto rows = make_rows(4, 64, 33, GgmlType::F16, 5, 2);  // stride 64*2 + 33*2 + 2 = 196 bytes
  auto plan = plan_layer_dma(region.target(), batch_for(rows, 0, 64, 33, GgmlType::F16, 0, 4));
  ASSERT_TRUE(plan) << plan.error().what();
  EXPECT_TRUE(plan->covers_k);
  EXPECT_FALSE(plan->covers_v);
  ASSERT_EQ(plan->cpu_fallback.size(), 1u);
  EXPECT_NE(plan->cpu_fallback[0].find("a V row of 66 bytes is not a whole number of 32-bit words"), std::string::npos)
      << plan->cpu_fallback[0];
}

// Regression: past the stride limit the planner made one descriptor per token, without
// bound, although a shim tile has 16.
TEST(DmaPlan, NeverPlansMoreDescriptorsThanAShimTileHas) {
  CacheSpec spec{{64}, {64}, 64};
  Region region(spec);
  const auto rows = make_rows(1, 64, 64, GgmlType::F16, 6);
  ScatterBatch batch = batch_for(rows, 0, 64, 64, GgmlType::F16, 0, 40);
  batch.row_stride = 8u << 20;  // 8 MiB between tokens: past the 0xFFFFF-word stride limit (planning reads no row)
  auto plan = plan_layer_dma(region.target(), batch);
  ASSERT_TRUE(plan) << plan.error().what();
  EXPECT_LE(plan->transfers.size(), ShimLimits::kBdsPerTile);
  EXPECT_FALSE(plan->covers_k);
  EXPECT_FALSE(plan->covers_v);
  ASSERT_EQ(plan->cpu_fallback.size(), 2u);
  EXPECT_NE(plan->cpu_fallback[0].find("cache_k_l0: needs 40 buffer descriptors, the shim tile has 16 left of 16"),
            std::string::npos)
      << plan->cpu_fallback[0];
}

TEST(DmaPlan, RefusesABatchOfSeveralLayers) {
  CacheSpec spec{{64, 64}, {64, 64}, 32};
  Region region(spec);
  const auto rows = make_rows(1, 64, 64, GgmlType::F16, 4);
  ScatterBatch batch = batch_for(rows, 0, 64, 64, GgmlType::F16, 0, 1);
  batch.layers.push_back({1, rows.bytes.data(), 64, 64});
  auto plan = plan_layer_dma(region.target(), batch);
  ASSERT_FALSE(plan);
  EXPECT_NE(plan.error().message().find("one layer, the batch has 2"), std::string::npos);
}

// A valid one-word transfer to mutate.
DmaPlan one_transfer() {
  DmaPlan plan;
  DmaTransfer t;
  t.read.dims = {DmaDim{4, 1}, DmaDim{1, 0}, DmaDim{1, 0}};
  t.write = t.read;
  plan.transfers.push_back(t);
  return plan;
}

std::string simulate_error(const DmaPlan& plan) {
  std::vector<std::byte> rows(1 << 24), k(1 << 24), v(16);
  auto result = simulate_dma(plan, rows, k, v);
  return result ? "" : result.error().message();
}

TEST(DmaSimulator, RunsAValidTransfer) { EXPECT_EQ(simulate_error(one_transfer()), ""); }

TEST(DmaSimulator, RefusesAnInnerSizeAbove1023) {
  DmaPlan plan = one_transfer();
  plan.transfers[0].read.dims[1] = {1024, 4};
  plan.transfers[0].write.dims[1] = {1024, 4};
  EXPECT_NE(simulate_error(plan).find("dimension 1 size 1024 passes the shim limit 1023"), std::string::npos);
}

TEST(DmaSimulator, RefusesARepeatAbove64) {
  DmaPlan plan = one_transfer();
  plan.transfers[0].read.repeat = 65;
  plan.transfers[0].write.repeat = 65;
  EXPECT_NE(simulate_error(plan).find("repeat 65 outside 1..64"), std::string::npos);
}

TEST(DmaSimulator, RefusesAStridePastTheLimit) {
  DmaPlan plan = one_transfer();
  plan.transfers[0].write.dims[1] = {2, 0x100000};
  plan.transfers[0].read.dims[1] = {2, 4};
  EXPECT_NE(simulate_error(plan).find("stride 1048576 words passes the shim limit 0xfffff"), std::string::npos);
}

TEST(DmaSimulator, RefusesMoreDescriptorsThanAShimTileHas) {
  DmaPlan plan;
  plan.transfers.assign(ShimLimits::kBdsPerTile + 1, one_transfer().transfers[0]);
  std::vector<std::byte> rows(4096), k(4096), v(4096);
  auto simulated = simulate_dma(plan, rows, k, v);
  ASSERT_FALSE(simulated);
  EXPECT_NE(simulated.error().message().find("shim tile 0 has only 16 buffer descriptors"), std::string::npos)
      << simulated.error().message();
}

TEST(DmaSimulator, RefusesAThirdChannel) {
  DmaPlan plan = one_transfer();
  plan.transfers[0].channel = 2;
  EXPECT_NE(simulate_error(plan).find("channel 2 but a shim tile has 2"), std::string::npos);
}

TEST(DmaSimulator, RefusesAWriteOutsideItsBuffer) {
  DmaPlan plan = one_transfer();
  plan.transfers[0].destination = DmaBuffer::cache_v;
  plan.transfers[0].write.offset_words = 2;
  EXPECT_NE(simulate_error(plan).find("write: reaches word 5 of cache_v (16 bytes)"), std::string::npos)
      << simulate_error(plan);
}

TEST(DmaSimulator, RefusesReadAndWriteOfDifferentLengths) {
  DmaPlan plan = one_transfer();
  plan.transfers[0].write.dims[0].size = 3;
  EXPECT_NE(simulate_error(plan).find("reads 4 words but writes 3"), std::string::npos);
}

}  // namespace
}  // namespace kvshare::xdna
