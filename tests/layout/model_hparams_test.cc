#include "layout/model_hparams.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <set>
#include <string>

#include "layout/model_shape.h"
#include "layout/shape_fixtures.h"

namespace kvshare::layout {
namespace {

using testing::string_value;
using testing::transformer;

TEST(ModelHparams, NamesTheFileAndTheKeyOfAWronglyTypedValue) {
  auto builder = transformer("llama", 2, 256, 4, 2);
  builder.set("rope.freq_base", string_value("10000"));
  auto hparams = read_model_hparams(builder.metadata(), "tiny.gguf");
  ASSERT_FALSE(hparams.has_value());
  EXPECT_EQ(hparams.error().errno_value(), EINVAL);
  const std::string& message = hparams.error().message();
  EXPECT_EQ(message.rfind("model tiny.gguf: ", 0), 0u) << message;
  EXPECT_NE(message.find("\"llama.rope.freq_base\""), std::string::npos) << message;
}

TEST(ModelHparams, DefaultsRopeAndNormAsLlamaCppDoes) {
  auto hparams = read_model_hparams(transformer("llama", 2, 256, 4, 2).metadata(), "tiny.gguf");
  ASSERT_TRUE(hparams.has_value()) << hparams.error().what();
  EXPECT_EQ(hparams->n_rot, 64u);  // the head size, 256 / 4
  EXPECT_EQ(hparams->rope_freq_base, 10000.0f);
  EXPECT_EQ(hparams->rope_scaling_type, "linear");
  EXPECT_EQ(hparams->rope_freq_scale, 1.0f);
  EXPECT_FALSE(hparams->rms_eps.has_value());
}

TEST(ModelHparams, ReadsRopeKeysAndTheRmsEpsilon) {
  auto builder = transformer("qwen3", 2, 256, 4, 2);
  builder.u32("attention.key_length", 32)
      .u32("attention.value_length", 32)
      .u32("rope.dimension_count", 16)
      .set("rope.freq_base", GgufValue{1000000.0f})
      .set("rope.scaling.type", string_value("yarn"))
      .set("rope.scaling.factor", GgufValue{4.0f})
      .set("attention.layer_norm_rms_epsilon", GgufValue{1e-5f});
  auto hparams = read_model_hparams(builder.metadata(), "tiny.gguf");
  ASSERT_TRUE(hparams.has_value()) << hparams.error().what();
  EXPECT_EQ(hparams->n_embd_head_k_full, 32u);
  EXPECT_EQ(hparams->n_rot, 16u);
  EXPECT_EQ(hparams->rope_freq_base, 1000000.0f);
  EXPECT_EQ(hparams->rope_scaling_type, "yarn");
  EXPECT_EQ(hparams->rope_freq_scale, 0.25f);
  ASSERT_TRUE(hparams->rms_eps.has_value());
  EXPECT_EQ(*hparams->rms_eps, 1e-5f);
}

TEST(ModelHparams, TakesTheRopeScaleFromTheOldKeyWhenTheFactorIsAbsent) {
  auto builder = transformer("llama", 2, 256, 4, 2);
  builder.set("rope.scale_linear", GgufValue{2.0f});
  auto hparams = read_model_hparams(builder.metadata(), "tiny.gguf");
  ASSERT_TRUE(hparams.has_value()) << hparams.error().what();
  EXPECT_EQ(hparams->rope_freq_scale, 0.5f);
}

TEST(ModelHparams, TreatsAZeroRopeScalingFactorAsNoScaling) {
  auto builder = transformer("llama", 2, 256, 4, 2);
  builder.set("rope.scaling.factor", GgufValue{0.0f}).set("rope.scale_linear", GgufValue{2.0f});
  auto hparams = read_model_hparams(builder.metadata(), "tiny.gguf");
  ASSERT_TRUE(hparams.has_value()) << hparams.error().what();
  EXPECT_EQ(hparams->rope_freq_scale, 1.0f);
}

TEST(ModelHparams, SpellsEveryKeyOnceUnderTheArch) {
  std::set<std::string_view> suffixes;
  const auto last = static_cast<int>(HparamKey::full_attention_interval);
  for (int i = 0; i <= last; ++i) {
    const std::string_view suffix = hparam_key_suffix(static_cast<HparamKey>(i));
    EXPECT_NE(suffix, "unknown") << i;
    EXPECT_TRUE(suffixes.insert(suffix).second) << suffix;
  }
  ModelHparams hparams;
  hparams.arch = "qwen3";
  EXPECT_EQ(hparams.key(HparamKey::attention_head_count_kv), "qwen3.attention.head_count_kv");
}

TEST(ModelHparams, ShapeFromTheReadEqualsTheShapeFromTheMetadata) {
  auto builder = transformer("gemma2", 4, 512, 8, 4);
  builder.u32("attention.sliding_window", 1024);
  auto hparams = read_model_hparams(builder.metadata(), "tiny.gguf");
  ASSERT_TRUE(hparams.has_value()) << hparams.error().what();
  auto from_read = model_shape_from_hparams(*hparams);
  auto from_metadata = derive_model_shape(builder.metadata());
  ASSERT_TRUE(from_read.has_value()) << from_read.error().what();
  ASSERT_TRUE(from_metadata.has_value()) << from_metadata.error().what();
  EXPECT_EQ(from_read->memory_kind, MemoryKind::kv_iswa);
  EXPECT_EQ(from_read->n_swa, 1024u);
  ASSERT_EQ(from_read->layers.size(), from_metadata->layers.size());
  for (size_t il = 0; il < from_read->layers.size(); ++il) {
    EXPECT_EQ(from_read->layers[il].is_swa, from_metadata->layers[il].is_swa) << il;
    EXPECT_EQ(from_read->layers[il].n_embd_k_gqa, from_metadata->layers[il].n_embd_k_gqa) << il;
  }
}

TEST(ModelShape, RefusesHparamsWhosePerLayerValuesDoNotSpanTheBlocks) {
  ModelHparams hparams;
  hparams.arch = "llama";
  hparams.n_layer_all = 2;
  auto shape = model_shape_from_hparams(hparams);
  ASSERT_FALSE(shape.has_value());
  EXPECT_EQ(shape.error().errno_value(), EINVAL);
  EXPECT_NE(shape.error().message().find("2 blocks"), std::string::npos) << shape.error().message();
}

}  // namespace
}  // namespace kvshare::layout
