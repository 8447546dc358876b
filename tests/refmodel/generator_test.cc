#include <gtest/gtest.h>

#include "layout/gguf_reader.h"
#include "refmodel/engine.h"
#include "refmodel/model_generator.h"
#include "refmodel/tiny_model.h"

namespace kvshare::refmodel {
namespace {

bool is_valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 0 || i + len > s.size()) return false;
    for (size_t j = 1; j < len; ++j)
      if ((static_cast<unsigned char>(s[i + j]) >> 6) != 2) return false;
    i += len;
  }
  return true;
}

TEST(ModelGenerator, GivesTheSameBytesForTheSameSeed) {
  GeneratorOptions o;
  auto a = generate_model_bytes(o);
  auto b = generate_model_bytes(o);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(*a, *b);
  o.seed = 2;
  auto c = generate_model_bytes(o);
  ASSERT_TRUE(c);
  EXPECT_NE(*a, *c);
}

TEST(ModelGenerator, WritesAModelTheLoaderAccepts) {
  for (const char* arch : {"qwen3", "qwen2", "llama"}) {
    GeneratorOptions o;
    o.arch = arch;
    auto model = testing::load_generated(o);
    ASSERT_NE(model, nullptr) << arch;
    EXPECT_EQ(model->shape().arch, arch);
    EXPECT_EQ(model->shape().n_layer, 2u);
    EXPECT_TRUE(model->tokenizer().supports_text());
  }
}

TEST(ModelGenerator, TiesTheLmHeadForQwen3AndNotForLlama) {
  auto has_output = [](const char* arch) {
    GeneratorOptions o;
    o.arch = arch;
    auto model = testing::load_generated(o);
    for (const auto& t : model->tensor_infos())
      if (t.name == "output.weight") return true;
    return false;
  };
  EXPECT_FALSE(has_output("qwen3"));
  EXPECT_TRUE(has_output("llama"));
}

TEST(ModelGenerator, EveryTokenDecodesToValidUtf8) {
  auto model = testing::load_generated({});
  ASSERT_NE(model, nullptr);
  const Tokenizer& tok = model->tokenizer();
  std::string all;
  for (int32_t id = 0; id < tok.n_vocab(); ++id) {
    const std::string piece = tok.token_to_piece(id);
    EXPECT_TRUE(is_valid_utf8(piece)) << "token " << id;
    all += piece;
  }
  EXPECT_TRUE(is_valid_utf8(all));
}

TEST(ModelGenerator, ShapeOnlyWritesTensorInfosWithoutData) {
  GeneratorOptions o;
  o.shape_only = true;
  o.n_layer = 28;
  o.n_embd = 1024;
  o.n_ff = 3072;
  o.n_head = 16;
  o.n_head_kv = 8;
  o.head_dim = 128;
  auto bytes = generate_model_bytes(o);
  ASSERT_TRUE(bytes) << bytes.error().what();
  EXPECT_LT(bytes->size(), 64u * 1024);
  auto file = layout::parse_gguf(*bytes, "shape-only");
  ASSERT_TRUE(file) << file.error().what();
  EXPECT_FALSE(file->has_tensor_data());
  EXPECT_EQ(file->metadata.get_u32("qwen3.block_count").value(), 28u);
}

TEST(ModelGenerator, RefusesHeadsThatDoNotDivide) {
  GeneratorOptions o;
  o.n_head = 6;
  o.n_head_kv = 4;
  auto bytes = generate_model_bytes(o);
  ASSERT_FALSE(bytes);
  EXPECT_NE(bytes.error().message().find("--heads 6 is not a multiple of --heads-kv 4"), std::string::npos);
}

TEST(ModelGenerator, RefusesQ80RowsThatAreNotWholeBlocks) {
  GeneratorOptions o;
  o.wtype = layout::GgmlType::Q8_0;
  o.n_embd = 48;
  auto bytes = generate_model_bytes(o);
  ASSERT_FALSE(bytes);
  EXPECT_NE(bytes.error().message().find("--embd = 48"), std::string::npos) << bytes.error().message();
}

}  // namespace
}  // namespace kvshare::refmodel
