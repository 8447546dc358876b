// The BPE tokenizer against llama.cpp: tests/data/refmodel-tokenize.tsv holds what
// llama_tokenize (llama.cpp d32676d) returns for a kvshare-mkmodel vocabulary.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "refmodel/bpe_tokenizer.h"
#include "refmodel/tiny_model.h"
#include "support/test_support.h"

namespace kvshare::refmodel {
namespace {

std::string unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size()) {
      const char c = s[++i];
      out.push_back(c == 'n' ? '\n' : c == 't' ? '\t' : c == 'r' ? '\r' : c);
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) ids.push_back(std::stoi(item));
  return ids;
}

TEST(BpeTokenizer, GivesLlamaCppsIdsOnTheGeneratedVocabulary) {
  auto model = testing::load_generated({});
  ASSERT_NE(model, nullptr);
  std::ifstream in(kvshare::testing::data_path("refmodel-tokenize.tsv"));
  std::string line;
  int cases = 0;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t tab1 = line.find('\t'), tab2 = line.find('\t', tab1 + 1);
    ASSERT_NE(tab2, std::string::npos) << line;
    const std::string text = unescape(line.substr(0, tab1));
    const auto with_special = model->tokenizer().tokenize(text, true, true);
    const auto plain = model->tokenizer().tokenize(text, false, false);
    ASSERT_TRUE(with_special && plain);
    EXPECT_EQ(*with_special, parse_ids(line.substr(tab1 + 1, tab2 - tab1 - 1))) << line.substr(0, tab1);
    EXPECT_EQ(*plain, parse_ids(line.substr(tab2 + 1))) << line.substr(0, tab1);
    EXPECT_EQ(model->tokenizer().detokenize(*with_special), text);
    ++cases;
  }
  EXPECT_GE(cases, 10);
}

TEST(BpeTokenizer, SplitsLikeTheQwen2PreTokenizer) {
  const std::vector<std::string> expected{"It", "'s", " ", "1", "2", " apples", "!!\n", "  ", " ok"};
  EXPECT_EQ(pre_tokenize_ascii("It's 12 apples!!\n   ok", true), expected);
}

TEST(BpeTokenizer, SplitsLikeTheGpt2PreTokenizer) {
  const std::vector<std::string> expected{"It", "'s", " 12", " apples", "!!", "\n  ", " ok"};
  EXPECT_EQ(pre_tokenize_ascii("It's 12 apples!!\n   ok", false), expected);
}

TEST(BpeTokenizer, MapsBytesAsGpt2Does) {
  EXPECT_EQ(gpt2_byte_to_codepoint('a'), static_cast<uint32_t>('a'));
  EXPECT_EQ(gpt2_byte_to_codepoint(' '), 0x120u);
  EXPECT_EQ(gpt2_byte_to_codepoint('\n'), 0x10Au);
  EXPECT_EQ(gpt2_byte_to_codepoint(0x00), 0x100u);
  EXPECT_EQ(gpt2_byte_to_codepoint(0xAD), 0x143u);
  EXPECT_EQ(gpt2_byte_to_codepoint(0xFF), 0xFFu);
}

TEST(BpeTokenizer, RefusesNonAsciiTextNamingTheOffset) {
  auto model = testing::load_generated({});
  auto ids = model->tokenizer().tokenize("caf\xc3\xa9", false, false);
  ASSERT_FALSE(ids);
  EXPECT_EQ(ids.error().errno_value(), ENOTSUP);
  EXPECT_NE(ids.error().message().find("offset 3"), std::string::npos) << ids.error().message();
}

TEST(BpeTokenizer, SaysTextIsUnsupportedForAnotherPreTokenizer) {
  layout::GgufMetadata md;
  md.set("tokenizer.ggml.model", {std::string("gpt2")});
  md.set("tokenizer.ggml.pre", {std::string("llama-bpe")});
  layout::GgufArray tokens{layout::GgufValueType::STRING, {{std::string("a")}, {std::string("b")}}};
  md.set("tokenizer.ggml.tokens", {tokens});
  md.set("tokenizer.ggml.merges", {layout::GgufArray{layout::GgufValueType::STRING, {{std::string("a b")}}}});
  auto tok = make_tokenizer(md, "m.gguf");
  ASSERT_TRUE(tok) << tok.error().what();
  EXPECT_FALSE((*tok)->supports_text());
  auto ids = (*tok)->tokenize("ab", false, false);
  ASSERT_FALSE(ids);
  EXPECT_NE(ids.error().message().find("\"llama-bpe\""), std::string::npos) << ids.error().message();
  EXPECT_NE(ids.error().message().find("pass token ids"), std::string::npos);
}

TEST(BpeTokenizer, EndsGenerationAtImEndAndEndOfText) {
  auto model = testing::load_generated({});
  const Tokenizer& t = model->tokenizer();
  const auto im_end = t.tokenize("<|im_end|>", false, true);
  const auto eot = t.tokenize("<|endoftext|>", false, true);
  ASSERT_TRUE(im_end && eot);
  ASSERT_EQ(im_end->size(), 1u);
  EXPECT_TRUE(t.is_end_of_generation((*im_end)[0]));
  EXPECT_TRUE(t.is_end_of_generation((*eot)[0]));
  EXPECT_EQ(t.eos_id(), (*im_end)[0]);
  EXPECT_FALSE(t.is_end_of_generation(t.tokenize("a", false, false)->at(0)));
  EXPECT_FALSE(t.add_bos());
}

TEST(ChatTemplate, RendersChatMlAsLlamaServerDoes) {
  auto model = testing::load_generated({});
  auto text = model->apply_chat_template({{"system", "Be brief."}, {"user", "Hi"}}, true);
  ASSERT_TRUE(text);
  EXPECT_EQ(*text, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

}  // namespace
}  // namespace kvshare::refmodel
