// The archs kvshare-mkmodel writes for memory kinds other than the plain KV cache: each
// file parses, and layout derives the memory llama.cpp builds for it, with the widths the
// options imply. (That llama.cpp itself loads and serves them: tests/integration/mkmodel_archs.)
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "layout/gguf_reader.h"
#include "layout/kv_params.h"
#include "layout/memory_shape.h"
#include "layout/model_shape.h"
#include "refmodel/model_generator.h"

namespace kvshare::refmodel {
namespace {

using layout::MemoryKind;

// A generated file, parsed; the bytes live as long as the file.
struct Generated {
  std::vector<std::byte> bytes;
  layout::GgufFile file;
  layout::ModelShape shape;
};

std::unique_ptr<Generated> generate(const GeneratorOptions& o) {
  auto out = std::make_unique<Generated>();
  auto bytes = generate_model_bytes(o);
  EXPECT_TRUE(bytes) << bytes.error().what();
  if (!bytes) return nullptr;
  out->bytes = std::move(*bytes);
  auto file = layout::parse_gguf(out->bytes, o.arch);
  EXPECT_TRUE(file) << file.error().what();
  if (!file) return nullptr;
  out->file = std::move(*file);
  auto shape = layout::derive_model_shape(out->file.metadata);
  EXPECT_TRUE(shape) << shape.error().what();
  if (!shape) return nullptr;
  out->shape = std::move(*shape);
  return out;
}

GeneratorOptions arch(const char* name) {
  GeneratorOptions o;
  o.arch = name;
  return o;
}

layout::MemoryShape memory_of(const layout::ModelShape& shape) {
  layout::KvParams params;
  params.n_ctx = 1024;
  auto memory = layout::derive_memory_shape(shape, params);
  EXPECT_TRUE(memory) << memory.error().what();
  return memory ? *memory : layout::MemoryShape{};
}

std::vector<float> f32_values(const Generated& g, const std::string& name) {
  const layout::GgufTensorInfo* info = g.file.find_tensor(name);
  EXPECT_NE(info, nullptr) << name;
  if (info == nullptr) return {};
  auto data = layout::tensor_data(g.file, *info);
  EXPECT_TRUE(data) << data.error().what();
  if (!data) return {};
  std::vector<float> values(data->size() / sizeof(float));
  std::memcpy(values.data(), data->data(), values.size() * sizeof(float));
  return values;
}

TEST(ModelGeneratorArchs, Mamba2IsRecurrentWithItsConvAndSsmStateWidths) {
  auto g = generate(arch("mamba2"));
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(g->shape.memory_kind, MemoryKind::recurrent);
  EXPECT_EQ(g->shape.n_layer, 2u);
  // d_inner 2 x 128 = 256, 1 group, d_state 16, d_conv 4.
  EXPECT_EQ(g->shape.n_embd_r, 3u * (256u + 2u * 16u));
  EXPECT_EQ(g->shape.n_embd_s, 16u * 256u);
  const layout::MemoryShape memory = memory_of(g->shape);
  EXPECT_TRUE(memory.kv_caches.empty());
  ASSERT_TRUE(memory.recurrent);
  EXPECT_EQ(memory.recurrent->layers.size(), 2u);
  // token_embd, output_norm, output and 9 per layer: llama.cpp refuses extras.
  EXPECT_EQ(g->file.tensors.size(), 3u + 2u * 9u);
}

TEST(ModelGeneratorArchs, Mamba2StoresNegativeDecayRates) {
  auto g = generate(arch("mamba2"));
  ASSERT_NE(g, nullptr);
  for (const char* name : {"blk.0.ssm_a", "blk.1.ssm_a"})
    for (float a : f32_values(*g, name)) EXPECT_LT(a, 0.0f) << name;
}

TEST(ModelGeneratorArchs, Lfm2AlternatesConvAndAttentionLayersAsAHybrid) {
  GeneratorOptions o = arch("lfm2");
  o.n_layer = 4;
  auto g = generate(o);
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(g->shape.memory_kind, MemoryKind::hybrid);
  for (uint32_t il = 0; il < 4; ++il) {
    EXPECT_EQ(g->shape.layers[il].is_recurrent, il % 2 == 0) << il;
    EXPECT_EQ(g->shape.layers[il].has_kv, il % 2 == 1) << il;
  }
  EXPECT_EQ(g->shape.n_embd_r, 128u * 3u);  // n_embd x (l_cache - 1)
  EXPECT_EQ(g->shape.n_embd_s, 0u);
  EXPECT_EQ(g->shape.layers[1].n_embd_k_gqa, 2u * 32u);  // 2 KV heads of 128 / 4
  EXPECT_EQ(g->file.metadata.find("lfm2.attention.sliding_window"), nullptr);
  const layout::MemoryShape memory = memory_of(g->shape);
  ASSERT_EQ(memory.kv_caches.size(), 1u);
  EXPECT_EQ(memory.kv_caches[0].layers.size(), 2u);
  ASSERT_TRUE(memory.recurrent);
  EXPECT_EQ(memory.recurrent->layers.size(), 2u);
  // token_embd, token_embd_norm, output; 8 per conv layer, 11 per attention layer.
  EXPECT_EQ(g->file.tensors.size(), 3u + 2u * 8u + 2u * 11u);
  EXPECT_NE(g->file.find_tensor("token_embd_norm.weight"), nullptr);
  EXPECT_NE(g->file.find_tensor("blk.0.shortconv.conv.weight"), nullptr);
  EXPECT_NE(g->file.find_tensor("blk.1.attn_q.weight"), nullptr);
}

TEST(ModelGeneratorArchs, Gemma3IsIswaWithEvenLayersSliding) {
  GeneratorOptions o = arch("gemma3");
  o.n_swa = 24;
  auto g = generate(o);
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(g->shape.memory_kind, MemoryKind::kv_iswa);
  EXPECT_EQ(g->shape.n_swa, 24u);
  EXPECT_TRUE(g->shape.layers[0].is_swa);
  EXPECT_FALSE(g->shape.layers[1].is_swa);
  EXPECT_EQ(g->shape.layers[0].n_embd_k_gqa, 2u * 64u);
  const layout::MemoryShape memory = memory_of(g->shape);
  ASSERT_EQ(memory.kv_caches.size(), 2u);
  EXPECT_EQ(memory.kv_caches[0].role, "base");
  ASSERT_EQ(memory.kv_caches[0].layers.size(), 1u);
  EXPECT_EQ(memory.kv_caches[0].layers[0].il, 1u);
  EXPECT_EQ(memory.kv_caches[1].role, "swa");
  ASSERT_EQ(memory.kv_caches[1].layers.size(), 1u);
  EXPECT_EQ(memory.kv_caches[1].layers[0].il, 0u);
  EXPECT_LT(memory.kv_caches[1].kv_size, memory.kv_caches[0].kv_size);
  // Tied (no output.weight), 13 per layer.
  EXPECT_EQ(g->file.tensors.size(), 2u + 2u * 13u);
}

TEST(ModelGeneratorArchs, Qwen35HasThreeGatedDeltaNetLayersThenAttentionWithMrope) {
  auto g = generate(arch("qwen35"));
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(g->shape.memory_kind, MemoryKind::hybrid);
  EXPECT_EQ(g->shape.n_layer, 4u);
  EXPECT_EQ(g->shape.n_pos_per_embd, 4u);
  for (uint32_t il = 0; il < 4; ++il) EXPECT_EQ(g->shape.layers[il].is_recurrent, il != 3) << il;
  EXPECT_TRUE(g->shape.layers[3].has_kv);
  EXPECT_EQ(g->shape.layers[3].n_embd_k_gqa, 2u * 64u);
  // GDN: 2 key heads and 4 value heads of 16; d_inner 64, conv 4.
  EXPECT_EQ(g->shape.n_embd_r, 3u * (64u + 2u * 2u * 16u));
  EXPECT_EQ(g->shape.n_embd_s, 16u * 64u);
  const layout::MemoryShape memory = memory_of(g->shape);
  ASSERT_EQ(memory.kv_caches.size(), 1u);
  EXPECT_EQ(memory.kv_caches[0].layers.size(), 1u);
  ASSERT_TRUE(memory.recurrent);
  EXPECT_EQ(memory.recurrent->layers.size(), 3u);
  // token_embd, output_norm, output; 14 per GDN layer, 11 per attention layer.
  EXPECT_EQ(g->file.tensors.size(), 3u + 3u * 14u + 11u);
}

// A random lm head gave <|im_end|> the best logit within a few tokens of a reply.
TEST(ModelGeneratorArchs, ZeroesTheLmHeadRowsOfControlTokens) {
  const std::vector<std::string> vocab = generated_vocabulary();
  for (const char* name : {"mamba2", "lfm2", "qwen35"}) {
    auto g = generate(arch(name));
    ASSERT_NE(g, nullptr);
    const std::vector<float> head = f32_values(*g, "output.weight");
    const size_t n_embd = 128;
    ASSERT_EQ(head.size(), vocab.size() * n_embd) << name;
    for (size_t id = 0; id < vocab.size(); ++id) {
      const bool is_control = vocab[id].starts_with("<|");
      bool all_zero = true;
      for (size_t i = 0; i < n_embd; ++i) all_zero = all_zero && head[id * n_embd + i] == 0.0f;
      EXPECT_EQ(all_zero, is_control) << name << " token " << id << " " << vocab[id];
    }
  }
}

TEST(ModelGeneratorArchs, GivesTheSameBytesForTheSameOptions) {
  for (const char* name : {"mamba2", "lfm2", "gemma3", "qwen35"}) {
    auto a = generate_model_bytes(arch(name));
    auto b = generate_model_bytes(arch(name));
    ASSERT_TRUE(a && b) << name;
    EXPECT_EQ(*a, *b) << name;
  }
}

TEST(ModelGeneratorArchs, WritesEveryArchWithQ80Weights) {
  for (const char* name : {"mamba2", "lfm2", "gemma3", "qwen35"}) {
    GeneratorOptions o = arch(name);
    o.wtype = layout::GgmlType::Q8_0;
    auto g = generate(o);
    ASSERT_NE(g, nullptr) << name;
    EXPECT_EQ(g->file.find_tensor("token_embd.weight")->type, layout::GgmlType::Q8_0) << name;
  }
}

std::string error_of(const GeneratorOptions& o) {
  auto ok = validate(o);
  EXPECT_FALSE(ok) << o.arch;
  return ok ? "" : ok.error().message();
}

TEST(ModelGeneratorArchs, NamesTheKnownArchsForAnUnknownOne) {
  EXPECT_EQ(error_of(arch("jamba")), "--arch jamba: not one of qwen3, qwen2, llama, gemma3, mamba2, lfm2, qwen35");
}

TEST(ModelGeneratorArchs, RefusesAHybridWithoutAnAttentionLayer) {
  GeneratorOptions o = arch("qwen35");
  o.n_layer = 2;
  EXPECT_NE(error_of(o).find("--layers 2 with --attn-every 4: a qwen35 model needs an attention layer"),
            std::string::npos)
      << error_of(o);
}

TEST(ModelGeneratorArchs, RefusesAHybridWithoutARecurrentLayer) {
  GeneratorOptions o = arch("lfm2");
  o.attn_every = 1;
  EXPECT_NE(error_of(o).find("--attn-every 1: a lfm2 model needs recurrent layers"), std::string::npos) << error_of(o);
}

TEST(ModelGeneratorArchs, RefusesSsmHeadsThatDoNotDivideMamba2sInnerSize) {
  GeneratorOptions o = arch("mamba2");
  o.ssm_n_head = 3;
  EXPECT_NE(error_of(o).find("--ssm-heads 3 does not divide mamba2's d_inner 256"), std::string::npos) << error_of(o);
}

TEST(ModelGeneratorArchs, RefusesGdnValueHeadsThatAreNotAMultipleOfKeyHeads) {
  GeneratorOptions o = arch("qwen35");
  o.ssm_n_group = 3;
  EXPECT_NE(error_of(o).find("--ssm-heads 4 (GDN value heads) is not a multiple of --ssm-groups 3"), std::string::npos)
      << error_of(o);
}

TEST(ModelGeneratorArchs, RefusesAnLfm2EmbeddingTheHeadsDoNotDivide) {
  GeneratorOptions o = arch("lfm2");
  o.n_head = 3;
  o.n_head_kv = 1;
  EXPECT_NE(error_of(o).find("--embd 128 is not a multiple of --heads 3"), std::string::npos) << error_of(o);
}

TEST(ModelGeneratorArchs, RefusesGemma3WithoutASlidingWindow) {
  GeneratorOptions o = arch("gemma3");
  o.n_swa = 0;
  EXPECT_NE(error_of(o).find("--swa-window 0"), std::string::npos) << error_of(o);
}

TEST(ModelGeneratorArchs, RefusesAQwen35HeadTooSmallForItsRopeSections) {
  GeneratorOptions o = arch("qwen35");
  o.head_dim = 16;
  EXPECT_NE(error_of(o).find("--head-dim 16: qwen35 needs an even head size of at least 32"), std::string::npos)
      << error_of(o);
}

TEST(ModelGeneratorArchs, RefusesAConvKernelWithoutState) {
  GeneratorOptions o = arch("mamba2");
  o.ssm_d_conv = 1;
  EXPECT_NE(error_of(o).find("--conv-kernel 1"), std::string::npos) << error_of(o);
}

}  // namespace
}  // namespace kvshare::refmodel
