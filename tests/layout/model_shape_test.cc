#include "layout/model_shape.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>

#include "layout/shape_fixtures.h"

namespace kvshare::layout {
namespace {

using testing::bool_array;
using testing::i32_array;
using testing::MetadataBuilder;
using testing::string_value;
using testing::transformer;
using testing::u32_array;
using testing::u32_value;

ModelShape derive_ok(const MetadataBuilder& builder) {
  auto shape = derive_model_shape(builder.metadata());
  EXPECT_TRUE(shape.has_value()) << shape.error().what();
  return shape ? *shape : ModelShape{};
}

TEST(ModelShape, DefaultsHeadSizesToEmbeddingOverHeadCount) {
  // Llama-3-8B: 4096 / 32 heads = 128 per head, 8 KV heads.
  const ModelShape shape = derive_ok(transformer("llama", 32, 4096, 32, 8, 8192));
  EXPECT_EQ(shape.arch, "llama");
  EXPECT_EQ(shape.n_layer, 32u);
  EXPECT_EQ(shape.n_ctx_train, 8192u);
  EXPECT_EQ(shape.memory_kind, MemoryKind::kv);
  ASSERT_EQ(shape.layers.size(), 32u);
  for (const LayerShape& layer : shape.layers) {
    EXPECT_EQ(layer.n_embd_head_k, 128u);
    EXPECT_EQ(layer.n_embd_head_v, 128u);
    EXPECT_EQ(layer.n_embd_k_gqa, 1024u);
    EXPECT_EQ(layer.n_embd_v_gqa, 1024u);
    EXPECT_TRUE(layer.has_kv);
    EXPECT_FALSE(layer.is_swa);
    EXPECT_FALSE(layer.is_recurrent);
  }
}

TEST(ModelShape, ReadsExplicitKeyAndValueLengths) {
  // Qwen3-Coder-30B-A3B: head 128 although 2048 / 32 would give 64.
  const ModelShape shape = derive_ok(testing::qwen3_coder_30b());
  EXPECT_EQ(shape.n_layer, 48u);
  EXPECT_EQ(shape.n_embd, 2048u);
  EXPECT_EQ(shape.layers[47].n_embd_head_k, 128u);
  EXPECT_EQ(shape.layers[47].n_embd_k_gqa, 512u);
  EXPECT_EQ(shape.layers[47].n_embd_v_gqa, 512u);
}

TEST(ModelShape, DefaultsKvHeadsToHeadCount) {
  auto builder = transformer("qwen2", 2, 1024, 16, 16).remove_by_rebuilding("attention.head_count_kv");
  const ModelShape shape = derive_ok(builder);
  EXPECT_EQ(shape.layers[0].n_head_kv, 16u);
  EXPECT_EQ(shape.layers[0].n_embd_k_gqa, 1024u);
}

TEST(ModelShape, ReadsPerLayerKvHeadArrays) {
  auto builder = transformer("qwen3", 3, 1024, 8, 1);
  builder.set("attention.head_count_kv", i32_array({2, 4, 8})).u32("attention.key_length", 128);
  const ModelShape shape = derive_ok(builder);
  EXPECT_EQ(shape.layers[0].n_embd_k_gqa, 256u);
  EXPECT_EQ(shape.layers[1].n_embd_k_gqa, 512u);
  EXPECT_EQ(shape.layers[2].n_embd_k_gqa, 1024u);
}

TEST(ModelShape, RefusesAPerLayerArrayOfTheWrongLength) {
  auto builder = transformer("qwen3", 3, 1024, 8, 1);
  builder.set("attention.head_count_kv", u32_array({2, 4}));
  auto shape = derive_model_shape(builder.metadata());
  ASSERT_FALSE(shape.has_value());
  EXPECT_NE(shape.error().message().find("qwen3.attention.head_count_kv"), std::string::npos) << shape.error().what();
}

TEST(ModelShape, Gemma2AlternatesSlidingAndFullLayersWithA4096Window) {
  auto builder = transformer("gemma2", 4, 2304, 8, 4);
  builder.u32("attention.key_length", 256).u32("attention.value_length", 256);
  const ModelShape shape = derive_ok(builder);
  EXPECT_EQ(shape.memory_kind, MemoryKind::kv_iswa);
  EXPECT_EQ(shape.swa_type, SwaType::standard);
  EXPECT_EQ(shape.n_swa, 4096u);
  EXPECT_TRUE(shape.layers[0].is_swa);
  EXPECT_FALSE(shape.layers[1].is_swa);
  EXPECT_TRUE(shape.layers[2].is_swa);
  EXPECT_FALSE(shape.layers[3].is_swa);
}

TEST(ModelShape, Gemma3MakesEverySixthLayerFullAndUsesSwaHeadSizes) {
  auto builder = transformer("gemma3", 12, 2560, 8, 4);
  builder.u32("attention.sliding_window", 1024)
      .u32("attention.key_length", 256)
      .u32("attention.value_length", 256)
      .u32("attention.key_length_swa", 128)
      .u32("attention.value_length_swa", 64);
  const ModelShape shape = derive_ok(builder);
  EXPECT_EQ(shape.memory_kind, MemoryKind::kv_iswa);
  EXPECT_EQ(shape.n_swa, 1024u);
  for (uint32_t il = 0; il < 12; ++il) {
    const bool full = il % 6 == 5;
    EXPECT_EQ(shape.layers[il].is_swa, !full) << "layer " << il;
    EXPECT_EQ(shape.layers[il].n_embd_k_gqa, full ? 1024u : 512u) << "layer " << il;
    EXPECT_EQ(shape.layers[il].n_embd_v_gqa, full ? 1024u : 256u) << "layer " << il;
  }
}

TEST(ModelShape, Gemma3HonoursAnExplicitSwaPeriod) {
  auto builder = transformer("gemma3", 4, 1024, 4, 1);
  builder.u32("attention.sliding_window", 512).u32("attention.sliding_window_pattern", 2);
  const ModelShape shape = derive_ok(builder);
  EXPECT_TRUE(shape.layers[0].is_swa);
  EXPECT_FALSE(shape.layers[1].is_swa);
}

TEST(ModelShape, Gemma3WithoutAWindowIsAPlainCache) {
  const ModelShape shape = derive_ok(transformer("gemma3", 4, 1024, 4, 1));
  EXPECT_EQ(shape.memory_kind, MemoryKind::kv);
  EXPECT_EQ(shape.swa_type, SwaType::none);
  for (const auto& layer : shape.layers) EXPECT_FALSE(layer.is_swa);
}

MetadataBuilder mamba2_model() {
  MetadataBuilder builder("mamba2");
  builder.u32("block_count", 4)
      .u32("context_length", 1048576)
      .u32("embedding_length", 2048)
      .u32("ssm.conv_kernel", 4)
      .u32("ssm.inner_size", 4096)
      .u32("ssm.state_size", 128)
      .u32("ssm.time_step_rank", 64)
      .u32("ssm.group_count", 8);
  return builder;
}

TEST(ModelShape, Mamba2IsRecurrentWithConvAndSsmStateWidths) {
  const ModelShape shape = derive_ok(mamba2_model());
  EXPECT_EQ(shape.memory_kind, MemoryKind::recurrent);
  // (4 - 1) * (4096 + 2 * 8 * 128) and 128 * 4096.
  EXPECT_EQ(shape.n_embd_r, 18432u);
  EXPECT_EQ(shape.n_embd_s, 524288u);
  for (const auto& layer : shape.layers) {
    EXPECT_TRUE(layer.is_recurrent);
    EXPECT_FALSE(layer.has_kv);
    EXPECT_EQ(layer.n_embd_k_gqa, 0u);
  }
}

TEST(ModelShape, Mamba2NamesAMissingSsmKey) {
  auto shape = derive_model_shape(mamba2_model().remove_by_rebuilding("ssm.group_count").metadata());
  ASSERT_FALSE(shape.has_value());
  EXPECT_EQ(shape.error().errno_value(), ENOENT);
  EXPECT_NE(shape.error().message().find("mamba2.ssm.group_count"), std::string::npos) << shape.error().what();
}

MetadataBuilder qwen3next_model(uint32_t n_layer) {
  // Qwen3-Next-80B's gated delta net: 16 K heads of 128, 32 V heads of 128.
  auto builder = transformer("qwen3next", n_layer, 2048, 16, 2, 262144);
  builder.u32("attention.key_length", 256)
      .u32("attention.value_length", 256)
      .u32("ssm.conv_kernel", 4)
      .u32("ssm.inner_size", 4096)
      .u32("ssm.state_size", 128)
      .u32("ssm.time_step_rank", 32)
      .u32("ssm.group_count", 16);
  return builder;
}

TEST(ModelShape, Qwen3NextMakesEveryFourthLayerAttentionAndTheRestGatedDeltaNet) {
  const ModelShape shape = derive_ok(qwen3next_model(8));
  EXPECT_EQ(shape.memory_kind, MemoryKind::hybrid);
  EXPECT_EQ(shape.n_embd_r, 24576u);   // 3 * (4096 + 2 * 16 * 128)
  EXPECT_EQ(shape.n_embd_s, 524288u);  // 128 * 4096
  for (uint32_t il = 0; il < 8; ++il) {
    const bool attention = (il + 1) % 4 == 0;
    EXPECT_EQ(shape.layers[il].has_kv, attention) << "layer " << il;
    EXPECT_EQ(shape.layers[il].is_recurrent, !attention) << "layer " << il;
  }
  EXPECT_EQ(shape.layers[3].n_embd_k_gqa, 512u);
}

TEST(ModelShape, Qwen3NextKeepsNextnLayersOutOfBothCaches) {
  auto builder = qwen3next_model(9);
  builder.u32("nextn_predict_layers", 1);
  const ModelShape shape = derive_ok(builder);
  EXPECT_EQ(shape.n_layer_all, 9u);
  EXPECT_EQ(shape.n_layer, 8u);
  EXPECT_TRUE(shape.layers[8].is_nextn);
  EXPECT_FALSE(shape.layers[8].has_kv);
  EXPECT_FALSE(shape.layers[8].is_recurrent);
}

TEST(ModelShape, Qwen3NextReadsTheRecurrentLayerArray) {
  auto builder = qwen3next_model(4);
  builder.set("attention.recurrent_layers", bool_array({true, false, true, false}));
  const ModelShape shape = derive_ok(builder);
  EXPECT_TRUE(shape.layers[0].is_recurrent);
  EXPECT_TRUE(shape.layers[1].has_kv);
  EXPECT_TRUE(shape.layers[2].is_recurrent);
  EXPECT_TRUE(shape.layers[3].has_kv);
}

TEST(ModelShape, Qwen3NextHonoursFullAttentionInterval) {
  auto builder = qwen3next_model(4);
  builder.u32("full_attention_interval", 2);
  const ModelShape shape = derive_ok(builder);
  EXPECT_TRUE(shape.layers[0].is_recurrent);
  EXPECT_TRUE(shape.layers[1].has_kv);
}

TEST(ModelShape, JambaMakesLayersWithoutKvHeadsRecurrent) {
  auto builder = transformer("jamba", 4, 4096, 32, 8);
  builder.set("attention.head_count_kv", u32_array({0, 0, 8, 0}))
      .u32("ssm.conv_kernel", 4)
      .u32("ssm.inner_size", 8192)
      .u32("ssm.state_size", 16)
      .u32("ssm.time_step_rank", 256);
  const ModelShape shape = derive_ok(builder);
  EXPECT_EQ(shape.memory_kind, MemoryKind::hybrid);
  EXPECT_EQ(shape.n_embd_r, 3u * 8192u);  // no group_count: n_group 0
  EXPECT_EQ(shape.n_embd_s, 16u * 8192u);
  EXPECT_TRUE(shape.layers[0].is_recurrent);
  EXPECT_FALSE(shape.layers[0].has_kv);
  EXPECT_TRUE(shape.layers[2].has_kv);
  EXPECT_FALSE(shape.layers[2].is_recurrent);
}

TEST(ModelShape, GraniteHybridCountsGroupsInTheConvState) {
  auto builder = transformer("granitehybrid", 3, 1536, 12, 4);
  builder.set("attention.head_count_kv", u32_array({0, 4, 0}))
      .u32("ssm.conv_kernel", 4)
      .u32("ssm.inner_size", 3072)
      .u32("ssm.state_size", 128)
      .u32("ssm.time_step_rank", 48)
      .u32("ssm.group_count", 1);
  const ModelShape shape = derive_ok(builder);
  EXPECT_EQ(shape.memory_kind, MemoryKind::hybrid);
  EXPECT_EQ(shape.n_embd_r, 3u * (3072u + 2u * 128u));
  EXPECT_EQ(shape.n_embd_s, 128u * 3072u);
  EXPECT_TRUE(shape.layers[0].is_recurrent);
  EXPECT_TRUE(shape.layers[1].has_kv);
  EXPECT_EQ(shape.layers[1].n_embd_k_gqa, 512u);  // 1536 / 12 = 128 per head
}

TEST(ModelShape, Mamba1HasNoGroupsInTheConvState) {
  MetadataBuilder builder("mamba");
  builder.u32("block_count", 2)
      .u32("context_length", 1048576)
      .u32("embedding_length", 768)
      .u32("ssm.conv_kernel", 4)
      .u32("ssm.inner_size", 1536)
      .u32("ssm.state_size", 16)
      .u32("ssm.time_step_rank", 48);
  const ModelShape shape = derive_ok(builder);
  EXPECT_EQ(shape.memory_kind, MemoryKind::recurrent);
  EXPECT_EQ(shape.n_embd_r, 3u * 1536u);
  EXPECT_EQ(shape.n_embd_s, 16u * 1536u);
}

// LFM2-1.2B's pattern, shortened: conv layers have head_count_kv 0.
MetadataBuilder lfm2_builder() {
  auto builder = transformer("lfm2", 4, 2048, 32, 8);
  builder.set("attention.head_count_kv", u32_array({0, 8, 0, 8})).u32("shortconv.l_cache", 3);
  return builder;
}

TEST(ModelShape, Lfm2MakesLayersWithoutKvHeadsShortConvWithAConvStateOnly) {
  const ModelShape shape = derive_ok(lfm2_builder());
  EXPECT_EQ(shape.memory_kind, MemoryKind::hybrid);
  EXPECT_EQ(shape.n_embd_r, 2048u * 2u);  // n_embd x (l_cache - 1)
  EXPECT_EQ(shape.n_embd_s, 0u);
  EXPECT_TRUE(shape.layers[0].is_recurrent);
  EXPECT_FALSE(shape.layers[0].has_kv);
  EXPECT_TRUE(shape.layers[1].has_kv);
  EXPECT_FALSE(shape.layers[1].is_recurrent);
  EXPECT_EQ(shape.layers[1].n_embd_k_gqa, 512u);  // 2048 / 32 = 64 per head, 8 KV heads
  EXPECT_TRUE(shape.layers[2].is_recurrent);
  EXPECT_TRUE(shape.layers[3].has_kv);
}

TEST(ModelShape, Lfm2WithASlidingWindowIsHybridIswaOverItsAttentionLayers) {
  auto builder = lfm2_builder();
  builder.u32("attention.sliding_window", 512);
  const ModelShape shape = derive_ok(builder);
  EXPECT_EQ(shape.memory_kind, MemoryKind::hybrid_iswa);
  EXPECT_EQ(shape.n_swa, 512u);
  EXPECT_FALSE(shape.layers[0].is_swa);
  EXPECT_TRUE(shape.layers[1].is_swa);
  EXPECT_TRUE(shape.layers[3].is_swa);
}

TEST(ModelShape, Lfm2NamesAMissingOrTooShortConvCache) {
  auto missing = lfm2_builder();
  missing.remove_by_rebuilding("shortconv.l_cache");
  auto shape = derive_model_shape(missing.metadata());
  ASSERT_FALSE(shape);
  EXPECT_NE(shape.error().message().find("lfm2.shortconv.l_cache"), std::string::npos) << shape.error().what();

  auto one = lfm2_builder();
  one.u32("shortconv.l_cache", 1);
  shape = derive_model_shape(one.metadata());
  ASSERT_FALSE(shape);
  EXPECT_EQ(shape.error().errno_value(), EINVAL);
  EXPECT_NE(shape.error().message().find("l_cache > 1"), std::string::npos) << shape.error().what();
}

TEST(ModelShape, DeepSeek2WithMlaKeysIsMla) {
  auto builder = transformer("deepseek2", 3, 2048, 16, 1);
  builder.u32("attention.key_length", 576)
      .u32("attention.value_length", 512)
      .u32("attention.key_length_mla", 192)
      .u32("attention.value_length_mla", 128)
      .u32("attention.kv_lora_rank", 512);
  const ModelShape shape = derive_ok(builder);
  EXPECT_TRUE(shape.is_mla);
  EXPECT_EQ(shape.memory_kind, MemoryKind::kv);
  EXPECT_EQ(shape.layers[0].n_embd_k_gqa, 576u);
}

TEST(ModelShape, DeepSeek2RefusesHalfOfTheMlaKeys) {
  auto builder = transformer("deepseek2", 3, 2048, 16, 1);
  builder.u32("attention.key_length_mla", 192).u32("attention.kv_lora_rank", 512);
  auto shape = derive_model_shape(builder.metadata());
  ASSERT_FALSE(shape.has_value());
  EXPECT_NE(shape.error().message().find("deepseek2.attention.value_length_mla"), std::string::npos);
}

TEST(ModelShape, MropeArchsHaveFourPositionsPerEmbedding) {
  auto builder = transformer("qwen2vl", 2, 1536, 12, 2);
  builder.set("rope.dimension_sections", i32_array({16, 24, 24, 0}));
  EXPECT_EQ(derive_ok(builder).n_pos_per_embd, 4u);
  EXPECT_EQ(derive_ok(transformer("qwen2", 2, 1536, 12, 2)).n_pos_per_embd, 1u);
}

TEST(ModelShape, MropeArchNamesAMissingSectionsKey) {
  auto shape = derive_model_shape(transformer("qwen3vl", 2, 1536, 12, 2).metadata());
  ASSERT_FALSE(shape.has_value());
  EXPECT_NE(shape.error().message().find("qwen3vl.rope.dimension_sections"), std::string::npos) << shape.error().what();
}

TEST(ModelShape, NamesAnUnknownArchAndTheKeysItWouldNeed) {
  auto shape = derive_model_shape(transformer("bert", 2, 768, 12, 12).metadata());
  ASSERT_FALSE(shape.has_value());
  EXPECT_EQ(shape.error().errno_value(), ENOTSUP);
  const std::string& message = shape.error().message();
  EXPECT_NE(message.find("\"bert\""), std::string::npos) << message;
  EXPECT_NE(message.find("bert.block_count"), std::string::npos) << message;
  EXPECT_NE(message.find("bert.attention.head_count_kv"), std::string::npos) << message;
  EXPECT_NE(message.find("qwen3moe"), std::string::npos) << message;
}

TEST(ModelShape, NamesAMissingRequiredKey) {
  auto shape =
      derive_model_shape(transformer("llama", 2, 256, 4, 2).remove_by_rebuilding("embedding_length").metadata());
  ASSERT_FALSE(shape.has_value());
  EXPECT_EQ(shape.error().errno_value(), ENOENT);
  EXPECT_NE(shape.error().message().find("llama.embedding_length"), std::string::npos) << shape.error().what();
}

TEST(ModelShape, NamesAWronglyTypedKey) {
  auto builder = transformer("llama", 2, 256, 4, 2);
  builder.set("context_length", string_value("4096"));
  auto shape = derive_model_shape(builder.metadata());
  ASSERT_FALSE(shape.has_value());
  EXPECT_NE(shape.error().message().find("llama.context_length"), std::string::npos) << shape.error().what();
}

TEST(ModelShape, NamesAMissingArchitectureKey) {
  GgufMetadata metadata;
  metadata.set("llama.block_count", u32_value(2));
  auto shape = derive_model_shape(metadata);
  ASSERT_FALSE(shape.has_value());
  EXPECT_NE(shape.error().message().find("general.architecture"), std::string::npos) << shape.error().what();
}

TEST(ModelShape, RefusesZeroOrTooManyLayers) {
  auto zero = derive_model_shape(transformer("llama", 0, 256, 4, 2).metadata());
  ASSERT_FALSE(zero.has_value());
  EXPECT_NE(zero.error().message().find("llama.block_count"), std::string::npos);
  EXPECT_FALSE(derive_model_shape(transformer("llama", 513, 256, 4, 2).metadata()).has_value());
}

TEST(ModelShape, RefusesAnAttentionModelWithoutHeads) {
  auto shape = derive_model_shape(transformer("llama", 2, 256, 0, 0).metadata());
  ASSERT_FALSE(shape.has_value());
  EXPECT_NE(shape.error().message().find("llama.attention.head_count"), std::string::npos) << shape.error().what();
}

TEST(ModelShape, ListsEveryRequiredArchAsSupported) {
  const auto& archs = supported_archs();
  for (std::string_view arch : {"llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "mamba2", "qwen3next",
                                "deepseek2", "qwen2vl", "jamba", "granitehybrid", "lfm2"})
    EXPECT_NE(std::find(archs.begin(), archs.end(), arch), archs.end()) << arch;
}

}  // namespace
}  // namespace kvshare::layout
