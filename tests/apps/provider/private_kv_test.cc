// PrivateContext, the provider's own cache and Context kept from one prefill to the next
// (a resident provider's): when it is reused, when it is made again, and that what a
// longer prompt left in it never reaches a shorter one's rows.
#include <gtest/gtest.h>

#include "apps/provider/private_kv.h"
#include "refmodel/model_impl.h"
#include "refmodel/tiny_model.h"

namespace kvshare::refmodel {
namespace {

using layout::GgmlType;
using testing::load_generated;
using testing::small_params;

std::vector<int32_t> ids(int n, int n_vocab, int salt) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back((i * 37 + salt) % n_vocab);
  return t;
}

// The first index at which `a` and `b` differ, -1 when they are equal (EXPECT_EQ on the
// vectors would print thousands of floats).
int64_t first_difference(const std::vector<float>& a, const std::vector<float>& b) {
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i)
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  return a.size() == b.size() ? -1 : static_cast<int64_t>(n);
}

// Every layer's rows a prefill of `tokens` hands its sink, concatenated.
std::vector<float> prefill_rows(Context& ctx, const std::vector<int32_t>& tokens) {
  std::vector<float> out;
  auto ok = ctx.prefill(tokens, [&](const LayerRows& r) -> Result<void> {
    out.insert(out.end(), r.rows.begin(), r.rows.end());
    return {};
  });
  EXPECT_TRUE(ok) << ok.error().what();
  return out;
}

class PrivateContextTest : public ::testing::Test {
 protected:
  void SetUp() override {
    GeneratorOptions options;
    options.residual_gain = 3.0f;  // later layers' K/V depend on the attention over earlier cells
    model_ = load_generated(options);
    ASSERT_NE(model_, nullptr);
  }
  std::shared_ptr<const Model> model_;
};

TEST_F(PrivateContextTest, KeepsItsContextForAShorterPromptOfTheSameTypesWhateverTheDecodersContext) {
  PrivateContext own;
  EXPECT_EQ(own.n_cells(), 0u);
  auto first = own.get(model_, small_params(4096, GgmlType::Q8_0, GgmlType::Q8_0), 300, 1);
  ASSERT_TRUE(first) << first.error().what();
  EXPECT_EQ(own.n_cells(), 512u);  // the prompt's 300 cells, rounded up to 256
  auto second = own.get(model_, small_params(8192, GgmlType::Q8_0, GgmlType::Q8_0), 512, 1);
  ASSERT_TRUE(second) << second.error().what();
  EXPECT_EQ(*second, *first);
  EXPECT_EQ(own.n_cells(), 512u);
}

TEST_F(PrivateContextTest, MakesANewContextForALongerPromptOrOtherCacheTypes) {
  PrivateContext own;
  ASSERT_TRUE(own.get(model_, small_params(4096), 300, 1));
  ASSERT_TRUE(own.get(model_, small_params(4096), 513, 1));
  EXPECT_EQ(own.n_cells(), 768u);
  ASSERT_TRUE(own.get(model_, small_params(4096), 10, 1));
  EXPECT_EQ(own.n_cells(), 768u);
  // Made again for the new types, at the size of the prompt that asked.
  auto q8_0 = own.get(model_, small_params(4096, GgmlType::Q8_0, GgmlType::Q8_0), 10, 1);
  ASSERT_TRUE(q8_0) << q8_0.error().what();
  EXPECT_EQ(own.n_cells(), 256u);
}

TEST_F(PrivateContextTest, RefusesAQuantizedVWithoutFlashAttentionAndKeepsNothing) {
  PrivateContext own;
  ASSERT_TRUE(own.get(model_, small_params(4096), 10, 1));
  auto refused = own.get(model_, small_params(4096, GgmlType::F16, GgmlType::Q8_0, false), 10, 1);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message().find("flash attention"), std::string::npos) << refused.error().what();
  EXPECT_EQ(own.n_cells(), 0u);
}

// The bug this guards against: a kept cache holds a longer prompt's cells past the next
// prompt's end, and a Context that attended over them would hand different rows.
TEST_F(PrivateContextTest, HandsAShortPromptAfterALongOneTheRowsOfAFreshOne) {
  for (const bool flash_attn : {true, false}) {
    const auto params = small_params(4096, GgmlType::F16, GgmlType::F16, flash_attn);
    const int n_vocab = model_->tokenizer().n_vocab();
    const auto long_prompt = ids(700, n_vocab, 11), short_prompt = ids(300, n_vocab, 5);
    PrivateContext kept, fresh;
    auto ctx = kept.get(model_, params, static_cast<uint32_t>(long_prompt.size()), 1);
    ASSERT_TRUE(ctx) << ctx.error().what();
    prefill_rows(**ctx, long_prompt);
    auto again = kept.get(model_, params, static_cast<uint32_t>(short_prompt.size()), 1);
    ASSERT_TRUE(again);
    ASSERT_EQ(*again, *ctx);  // the same Context, its cells 300..699 the long prompt's
    auto other = fresh.get(model_, params, static_cast<uint32_t>(short_prompt.size()), 1);
    ASSERT_TRUE(other);
    const auto after_long = prefill_rows(**again, short_prompt);
    const auto alone = prefill_rows(**other, short_prompt);
    ASSERT_FALSE(alone.empty());
    EXPECT_EQ(first_difference(after_long, alone), -1) << (flash_attn ? "V rows" : "transposed V");
  }
}

}  // namespace
}  // namespace kvshare::refmodel
