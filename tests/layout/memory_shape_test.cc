#include "layout/memory_shape.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <string>

#include "layout/shape_fixtures.h"

namespace kvshare::layout {
namespace {

using testing::MetadataBuilder;
using testing::transformer;
using testing::u32_array;

ModelShape model_of(const MetadataBuilder& builder) {
  auto shape = derive_model_shape(builder.metadata());
  EXPECT_TRUE(shape.has_value()) << shape.error().what();
  return shape ? *shape : ModelShape{};
}

MemoryShape memory_of(const ModelShape& model, const KvParams& params) {
  auto memory = derive_memory_shape(model, params);
  EXPECT_TRUE(memory.has_value()) << memory.error().what();
  return memory ? *memory : MemoryShape{};
}

KvParams params_with_ctx(uint32_t n_ctx) {
  KvParams params;
  params.n_ctx = n_ctx;
  return params;
}

TEST(MemoryShape, PadsTheContextTo256Cells) {
  const ModelShape model = model_of(testing::worked_example_model());
  EXPECT_EQ(memory_of(model, params_with_ctx(1000)).n_ctx, 1024u);
  EXPECT_EQ(memory_of(model, params_with_ctx(1024)).n_ctx, 1024u);
  EXPECT_EQ(memory_of(model, params_with_ctx(1)).kv_caches[0].kv_size, 256u);
}

TEST(MemoryShape, TakesTheTrainedContextForCZero) {
  const ModelShape model = model_of(transformer("llama", 2, 256, 4, 2, 5000));
  const MemoryShape memory = memory_of(model, params_with_ctx(0));
  EXPECT_EQ(memory.n_ctx, 5120u);
  EXPECT_EQ(memory.kv_caches[0].kv_size, 5120u);
}

TEST(MemoryShape, RefusesCZeroWhenTheModelHasNoTrainedContext) {
  const ModelShape model = model_of(transformer("llama", 2, 256, 4, 2, 0));
  auto memory = derive_memory_shape(model, params_with_ctx(0));
  ASSERT_FALSE(memory.has_value());
  EXPECT_NE(memory.error().message().find("-c 0"), std::string::npos);
}

TEST(MemoryShape, NamesLlamaTensorsWithTheirShapesAndSizes) {
  const ModelShape model = model_of(testing::worked_example_model());
  const MemoryShape memory = memory_of(model, params_with_ctx(512));
  EXPECT_EQ(memory.kind, MemoryKind::kv);
  ASSERT_EQ(memory.kv_caches.size(), 1u);
  const KvCacheShape& cache = memory.kv_caches[0];
  EXPECT_EQ(cache.role, "kv");
  EXPECT_EQ(cache.kv_size, 512u);
  EXPECT_EQ(cache.n_stream, 1u);
  EXPECT_FALSE(cache.v_trans);
  ASSERT_EQ(cache.tensors.size(), 4u);
  const char* names[] = {"cache_k_l0", "cache_v_l0", "cache_k_l1", "cache_v_l1"};
  for (size_t i = 0; i < 4; ++i) {
    const CacheTensor& t = cache.tensors[i];
    EXPECT_EQ(t.name, names[i]);
    EXPECT_EQ(t.layer, i / 2);
    EXPECT_EQ(t.kind, i % 2 == 0 ? TensorKind::k : TensorKind::v);
    EXPECT_EQ(t.type, GgmlType::F16);
    EXPECT_EQ(t.ne, (std::array<int64_t, 4>{128, 512, 1, 1}));
    EXPECT_EQ(t.row_bytes, 256u);
    EXPECT_EQ(t.nbytes, 131072u);
  }
  EXPECT_FALSE(memory.recurrent.has_value());
}

TEST(MemoryShape, SplitsTheContextIntoStreamsWithoutAUnifiedCache) {
  const ModelShape model = model_of(testing::worked_example_model());
  KvParams params = params_with_ctx(512);
  params.n_seq_max = 2;
  params.kv_unified = false;
  const MemoryShape memory = memory_of(model, params);
  EXPECT_EQ(memory.n_ctx_seq, 256u);
  EXPECT_EQ(memory.kv_caches[0].n_stream, 2u);
  EXPECT_EQ(memory.kv_caches[0].tensors[0].ne, (std::array<int64_t, 4>{128, 256, 2, 1}));
}

TEST(MemoryShape, RoundsEachStreamUpTo256AndRecomputesTheContext) {
  const ModelShape model = model_of(testing::worked_example_model());
  KvParams params = params_with_ctx(1000);
  params.n_seq_max = 3;
  params.kv_unified = false;
  const MemoryShape memory = memory_of(model, params);
  // pad256(1000) = 1024; 1024 / 3 = 341 -> 512 per stream; n_ctx becomes 3 * 512.
  EXPECT_EQ(memory.n_ctx_seq, 512u);
  EXPECT_EQ(memory.n_ctx, 1536u);
}

TEST(MemoryShape, KeepsOneStreamForAUnifiedCacheOfManySequences) {
  const ModelShape model = model_of(testing::worked_example_model());
  KvParams params = params_with_ctx(1024);
  params.n_seq_max = 4;
  const MemoryShape memory = memory_of(model, params);
  EXPECT_EQ(memory.kv_caches[0].n_stream, 1u);
  EXPECT_EQ(memory.kv_caches[0].kv_size, 1024u);
}

// llama-server's -c / -np / -kvu against the cache llama.cpp builds. Expected numbers follow
// llama_context::llama_context (llama-context.cpp): n_ctx = GGML_PAD(-c, 256); unified,
// n_ctx_seq = n_ctx; otherwise n_ctx_seq = GGML_PAD(n_ctx / n_seq_max, 256) and n_ctx =
// n_ctx_seq * n_seq_max. llama_model::create_memory gives llama_kv_cache kv_size =
// n_ctx_seq, and its constructor n_stream = unified ? 1 : n_seq_max.
struct StreamSplit {
  uint32_t n_ctx;      // -c
  uint32_t n_seq_max;  // -np
  bool kv_unified;     // -kvu
  uint32_t kv_size;    // cells per stream
  uint32_t n_stream;
  uint32_t n_ctx_out;  // llama_n_ctx(): every stream's cells
};

void PrintTo(const StreamSplit& c, std::ostream* os) {
  *os << "-c " << c.n_ctx << " -np " << c.n_seq_max << (c.kv_unified ? " -kvu" : "");
}

class MemoryShapeStreams : public ::testing::TestWithParam<StreamSplit> {
 protected:
  static KvParams params_of(const StreamSplit& c) {
    KvParams params = params_with_ctx(c.n_ctx);
    params.n_seq_max = c.n_seq_max;
    params.kv_unified = c.kv_unified;
    return params;
  }
};

TEST_P(MemoryShapeStreams, GivesEachStreamTheCellsLlamaContextGivesIt) {
  const StreamSplit c = GetParam();
  const MemoryShape memory = memory_of(model_of(testing::worked_example_model()), params_of(c));
  ASSERT_EQ(memory.kv_caches.size(), 1u);
  EXPECT_EQ(memory.kv_caches[0].kv_size, c.kv_size);
  EXPECT_EQ(memory.kv_caches[0].n_stream, c.n_stream);
  EXPECT_EQ(memory.n_ctx_seq, c.kv_size);
  EXPECT_EQ(memory.n_ctx, c.n_ctx_out);
  EXPECT_EQ(memory.kv_caches[0].tensors[0].ne, (std::array<int64_t, 4>{128, c.kv_size, c.n_stream, 1}));
}

// Issue #27: the patched llama-server passed its cache's cells per stream as n_ctx, and -c
// 1024 -np 2 came out as [128, 256, 2]. A caller that knows only its cache passes kv_size *
// n_stream (llama_n_ctx()): that must derive the same cache as the -c it was made from.
TEST_P(MemoryShapeStreams, DerivesTheSameCacheFromTheContextLlamaReports) {
  const StreamSplit c = GetParam();
  const ModelShape model = model_of(testing::worked_example_model());
  KvParams params = params_of(c);
  params.n_ctx = c.kv_size * c.n_stream;
  const MemoryShape again = memory_of(model, params);
  ASSERT_EQ(again.kv_caches.size(), 1u);
  EXPECT_EQ(again.kv_caches[0].kv_size, c.kv_size);
  EXPECT_EQ(again.kv_caches[0].n_stream, c.n_stream);
  EXPECT_EQ(again.n_ctx, c.n_ctx_out);
}

INSTANTIATE_TEST_SUITE_P(LlamaServerFlags, MemoryShapeStreams,
                         ::testing::Values(StreamSplit{512, 2, false, 256, 2, 512},     // 512 / 2
                                           StreamSplit{1024, 2, false, 512, 2, 1024},   // 1024 / 2
                                           StreamSplit{2048, 2, false, 1024, 2, 2048},  // 2048 / 2
                                           StreamSplit{1024, 4, false, 256, 4, 1024},   // 1024 / 4
                                           StreamSplit{768, 3, false, 256, 3, 768},     // 768 / 3
                                           StreamSplit{1000, 3, false, 512, 3, 1536},   // pad256(1024 / 3)
                                           StreamSplit{1024, 2, true, 1024, 1, 1024},   // one stream
                                           StreamSplit{4096, 4, true, 4096, 1, 4096}),
                         [](const ::testing::TestParamInfo<StreamSplit>& info) {
                           const StreamSplit& c = info.param;
                           return "c" + std::to_string(c.n_ctx) + "_np" + std::to_string(c.n_seq_max) +
                                  (c.kv_unified ? "_unified" : "_split");
                         });

// kvshare-mkmodel's gemma3 (window 32) per stream: llama_kv_cache_iswa's constructor sizes
// the SWA cache GGML_PAD(min(kv_size, n_swa * (unified ? n_seq_max : 1) + n_ubatch), 256),
// with kv_size the base cache's cells per stream, and gives both caches the same streams.
TEST(MemoryShape, SizesEachStreamOfAnIswaPairFromItsOwnShareOfTheContext) {
  const ModelShape model = model_of(testing::mkmodel_gemma3());
  KvParams params = params_with_ctx(2048);
  params.n_seq_max = 2;
  params.kv_unified = false;
  const MemoryShape split = memory_of(model, params);
  ASSERT_EQ(split.kv_caches.size(), 2u);
  EXPECT_EQ(split.kv_caches[0].kv_size, 1024u);
  EXPECT_EQ(split.kv_caches[0].n_stream, 2u);
  EXPECT_EQ(split.kv_caches[1].kv_size, 768u);  // pad256(min(1024, 32 + 512))
  EXPECT_EQ(split.kv_caches[1].n_stream, 2u);
  EXPECT_EQ(split.kv_caches[1].tensors[0].ne, (std::array<int64_t, 4>{128, 768, 2, 1}));

  params.n_ctx = 1024;  // 512 cells per stream: the window and a micro-batch do not fit
  EXPECT_EQ(memory_of(model, params).kv_caches[1].kv_size, 512u);

  params.kv_unified = true;  // one stream holding both sequences' windows
  const MemoryShape unified = memory_of(model, params);
  EXPECT_EQ(unified.kv_caches[0].kv_size, 1024u);
  EXPECT_EQ(unified.kv_caches[1].kv_size, 768u);  // pad256(min(1024, 2 * 32 + 512))
  EXPECT_EQ(unified.kv_caches[1].n_stream, 1u);
}

MetadataBuilder uneven_kv_heads() {
  auto builder = transformer("llama", 2, 1024, 8, 1);
  builder.set("attention.head_count_kv", u32_array({8, 4}));
  return builder;
}

TEST(MemoryShape, WidensEveryTransposedVToTheWidestLayer) {
  const ModelShape model = model_of(uneven_kv_heads());
  KvParams params = params_with_ctx(256);
  params.flash_attn = false;
  const KvCacheShape cache = memory_of(model, params).kv_caches[0];
  EXPECT_TRUE(cache.v_trans);
  EXPECT_EQ(cache.v_width, 1024u);
  EXPECT_EQ(cache.tensors[3].name, "cache_v_l1");
  EXPECT_EQ(cache.tensors[3].ne[0], 1024);
  EXPECT_EQ(cache.tensors[2].ne[0], 512);  // K keeps its own width
}

TEST(MemoryShape, KeepsPerLayerVWidthsWithFlashAttention) {
  const ModelShape model = model_of(uneven_kv_heads());
  const KvCacheShape cache = memory_of(model, params_with_ctx(256)).kv_caches[0];
  EXPECT_FALSE(cache.v_trans);
  EXPECT_EQ(cache.tensors[3].ne[0], 512);
}

TEST(MemoryShape, SizesQuantizedRowsWithGgmlRowSize) {
  const ModelShape model = model_of(testing::worked_example_model());
  KvParams params = params_with_ctx(256);
  params.type_k = GgmlType::Q8_0;
  params.type_v = GgmlType::Q4_0;
  const KvCacheShape cache = memory_of(model, params).kv_caches[0];
  EXPECT_EQ(cache.tensors[0].row_bytes, 136u);  // 4 blocks of 34
  EXPECT_EQ(cache.tensors[0].nbytes, 136u * 256u);
  EXPECT_EQ(cache.tensors[1].row_bytes, 72u);  // 4 blocks of 18
}

TEST(MemoryShape, RefusesAQuantizedVWithoutFlashAttention) {
  const ModelShape model = model_of(testing::worked_example_model());
  KvParams params = params_with_ctx(256);
  params.type_v = GgmlType::Q8_0;
  params.flash_attn = false;
  auto memory = derive_memory_shape(model, params);
  ASSERT_FALSE(memory.has_value());
  EXPECT_EQ(memory.error().errno_value(), EINVAL);
  EXPECT_NE(memory.error().message().find("-ctv q8_0"), std::string::npos) << memory.error().what();
}

TEST(MemoryShape, RefusesAQuantizedKWhoseBlockDoesNotDivideTheHead) {
  auto builder = transformer("llama", 1, 320, 4, 4);  // head 80
  const ModelShape model = model_of(builder);
  KvParams params = params_with_ctx(256);
  params.type_k = GgmlType::Q8_0;
  auto memory = derive_memory_shape(model, params);
  ASSERT_FALSE(memory.has_value());
  EXPECT_NE(memory.error().message().find("-ctk q8_0"), std::string::npos) << memory.error().what();
}

MetadataBuilder gemma3_model() {
  auto builder = transformer("gemma3", 6, 2560, 8, 4, 131072);
  builder.u32("attention.sliding_window", 1024).u32("attention.key_length", 256).u32("attention.value_length", 256);
  return builder;
}

TEST(MemoryShape, GivesSwaModelsABaseAndAWindowSizedSwaCache) {
  const ModelShape model = model_of(gemma3_model());
  const MemoryShape memory = memory_of(model, params_with_ctx(8192));
  ASSERT_EQ(memory.kv_caches.size(), 2u);
  const KvCacheShape& base = memory.kv_caches[0];
  const KvCacheShape& swa = memory.kv_caches[1];
  EXPECT_EQ(base.role, "base");
  EXPECT_EQ(base.kv_size, 8192u);
  ASSERT_EQ(base.layers.size(), 1u);
  EXPECT_EQ(base.layers[0].il, 5u);
  EXPECT_EQ(base.n_swa, 0u);
  EXPECT_EQ(swa.role, "swa");
  EXPECT_EQ(swa.kv_size, 1536u);  // pad256(min(8192, 1024 + 512))
  EXPECT_EQ(swa.layers.size(), 5u);
  EXPECT_EQ(swa.n_swa, 1024u);
  EXPECT_EQ(swa.swa_type, SwaType::standard);
  EXPECT_EQ(swa.tensors[0].name, "cache_k_l0");
}

TEST(MemoryShape, SizesTheSwaCacheForEveryUnifiedSequence) {
  const ModelShape model = model_of(gemma3_model());
  KvParams params = params_with_ctx(8192);
  params.n_seq_max = 2;
  EXPECT_EQ(memory_of(model, params).kv_caches[1].kv_size, 2560u);  // 2 * 1024 + 512
  params.n_ubatch = 100;
  EXPECT_EQ(memory_of(model, params).kv_caches[1].kv_size, 2304u);  // pad256(2148)
}

TEST(MemoryShape, CapsTheSwaCacheAtTheBaseSize) {
  const ModelShape model = model_of(gemma3_model());
  EXPECT_EQ(memory_of(model, params_with_ctx(1024)).kv_caches[1].kv_size, 1024u);
}

TEST(MemoryShape, MakesTheSwaCacheFullSizeWithSwaFull) {
  const ModelShape model = model_of(gemma3_model());
  KvParams params = params_with_ctx(8192);
  params.swa_full = true;
  EXPECT_EQ(memory_of(model, params).kv_caches[1].kv_size, 8192u);
}

ModelShape mla_model() {
  auto builder = transformer("deepseek2", 2, 2048, 16, 1);
  builder.u32("attention.key_length", 576)
      .u32("attention.value_length", 512)
      .u32("attention.key_length_mla", 192)
      .u32("attention.value_length_mla", 128)
      .u32("attention.kv_lora_rank", 512);
  return model_of(builder);
}

TEST(MemoryShape, GivesMlaModelsOnlyK) {
  const KvCacheShape cache = memory_of(mla_model(), params_with_ctx(256)).kv_caches[0];
  ASSERT_EQ(cache.tensors.size(), 2u);
  EXPECT_EQ(cache.tensors[0].name, "cache_k_l0");
  EXPECT_EQ(cache.tensors[1].name, "cache_k_l1");
  EXPECT_EQ(cache.tensors[0].ne[0], 576);
  EXPECT_FALSE(cache.layers[0].has_v);
}

TEST(MemoryShape, RefusesDifferentKAndVTypesForMla) {
  KvParams params = params_with_ctx(256);
  params.type_v = GgmlType::BF16;
  auto memory = derive_memory_shape(mla_model(), params);
  ASSERT_FALSE(memory.has_value());
  EXPECT_NE(memory.error().message().find("MLA"), std::string::npos) << memory.error().what();
}

ModelShape mamba2_model() {
  MetadataBuilder builder("mamba2");
  builder.u32("block_count", 2)
      .u32("context_length", 4096)
      .u32("embedding_length", 768)
      .u32("ssm.conv_kernel", 4)
      .u32("ssm.inner_size", 1536)
      .u32("ssm.state_size", 128)
      .u32("ssm.time_step_rank", 24)
      .u32("ssm.group_count", 1);
  return model_of(builder);
}

TEST(MemoryShape, GivesRecurrentModelsOneStateRowPerSequence) {
  KvParams params = params_with_ctx(4096);
  params.n_seq_max = 3;
  const MemoryShape memory = memory_of(mamba2_model(), params);
  EXPECT_TRUE(memory.kv_caches.empty());
  ASSERT_TRUE(memory.recurrent.has_value());
  const RecurrentShape& rs = *memory.recurrent;
  EXPECT_EQ(rs.rs_size, 3u);
  EXPECT_EQ(rs.n_layer, 2u);
  ASSERT_EQ(rs.tensors.size(), 4u);
  EXPECT_EQ(rs.tensors[0].name, "cache_r_l0");
  EXPECT_EQ(rs.tensors[1].name, "cache_s_l0");
  EXPECT_EQ(rs.tensors[2].name, "cache_r_l1");
  EXPECT_EQ(rs.tensors[0].type, GgmlType::F32);
  // (4 - 1) * (1536 + 2 * 1 * 128) = 5376; 128 * 1536 = 196608.
  EXPECT_EQ(rs.tensors[0].ne, (std::array<int64_t, 4>{5376, 3, 1, 1}));
  EXPECT_EQ(rs.tensors[1].ne, (std::array<int64_t, 4>{196608, 3, 1, 1}));
  EXPECT_EQ(rs.tensors[1].nbytes, 196608u * 4u * 3u);
  EXPECT_EQ(kv_bytes_per_token(memory), 0u);
}

TEST(MemoryShape, SplitsHybridLayersBetweenAttentionAndRecurrentState) {
  auto builder = transformer("qwen3next", 8, 2048, 16, 2);
  builder.u32("attention.key_length", 256)
      .u32("attention.value_length", 256)
      .u32("ssm.conv_kernel", 4)
      .u32("ssm.inner_size", 4096)
      .u32("ssm.state_size", 128)
      .u32("ssm.time_step_rank", 32)
      .u32("ssm.group_count", 16);
  const MemoryShape memory = memory_of(model_of(builder), params_with_ctx(4096));
  EXPECT_EQ(memory.kind, MemoryKind::hybrid);
  ASSERT_EQ(memory.kv_caches.size(), 1u);
  ASSERT_EQ(memory.kv_caches[0].tensors.size(), 4u);
  EXPECT_EQ(memory.kv_caches[0].tensors[0].name, "cache_k_l3");
  EXPECT_EQ(memory.kv_caches[0].tensors[2].name, "cache_k_l7");
  ASSERT_TRUE(memory.recurrent.has_value());
  EXPECT_EQ(memory.recurrent->layers.size(), 6u);
  EXPECT_EQ(memory.recurrent->tensors[0].ne[0], 24576);
  EXPECT_EQ(memory.recurrent->tensors[1].ne[0], 524288);
  EXPECT_EQ(memory.recurrent->rs_size, 1u);
}

TEST(MemoryShape, GivesLfm2ConvLayersAConvStateAndAnEmptySsmState) {
  auto builder = transformer("lfm2", 4, 1024, 16, 8);
  builder.set("attention.head_count_kv", u32_array({0, 8, 0, 8})).u32("shortconv.l_cache", 3);
  const MemoryShape memory = memory_of(model_of(builder), params_with_ctx(4096));
  EXPECT_EQ(memory.kind, MemoryKind::hybrid);
  ASSERT_EQ(memory.kv_caches.size(), 1u);
  ASSERT_EQ(memory.kv_caches[0].tensors.size(), 4u);
  EXPECT_EQ(memory.kv_caches[0].tensors[0].name, "cache_k_l1");
  EXPECT_EQ(memory.kv_caches[0].tensors[0].ne[0], 512);  // 8 KV heads of 1024 / 16
  EXPECT_EQ(memory.kv_caches[0].tensors[2].name, "cache_k_l3");
  ASSERT_TRUE(memory.recurrent.has_value());
  ASSERT_EQ(memory.recurrent->tensors.size(), 4u);
  EXPECT_EQ(memory.recurrent->tensors[0].name, "cache_r_l0");
  EXPECT_EQ(memory.recurrent->tensors[0].ne[0], 2048);  // 1024 x (l_cache - 1)
  EXPECT_EQ(memory.recurrent->tensors[1].name, "cache_s_l0");
  EXPECT_EQ(memory.recurrent->tensors[1].nbytes, 0u);
  EXPECT_EQ(memory.recurrent->tensors[2].name, "cache_r_l2");
}

TEST(MemoryShape, CountsBytesPerTokenOverKAndV) {
  const ModelShape model = model_of(testing::qwen3_coder_30b());
  const MemoryShape memory = memory_of(model, params_with_ctx(8192));
  EXPECT_EQ(kv_bytes_per_token(memory), 48u * 2u * 512u * 2u);
}

TEST(KvParams, RefusesZeroSequences) {
  KvParams params;
  params.n_seq_max = 0;
  auto result = validate(params);
  ASSERT_FALSE(result.has_value());
  EXPECT_NE(result.error().message().find("-np 0"), std::string::npos);
}

TEST(KvParams, RefusesACacheTypeLlamaServerDoesNotAccept) {
  KvParams params;
  params.type_k = GgmlType::Q4_K;
  auto result = validate(params);
  ASSERT_FALSE(result.has_value());
  EXPECT_NE(result.error().message().find("-ctk"), std::string::npos) << result.error().what();
}

TEST(KvParams, DescribesTheFlagsAHumanCompares) {
  KvParams params;
  params.n_ctx = 8192;
  EXPECT_EQ(describe(params), "-c 8192 -np 1 -ctk f16 -ctv f16 -fa on");
  params.n_seq_max = 2;
  params.flash_attn = false;
  params.swa_full = true;
  EXPECT_EQ(describe(params), "-c 8192 -np 2 -kvu -ctk f16 -ctv f16 -fa off --swa-full");
}

}  // namespace
}  // namespace kvshare::layout
