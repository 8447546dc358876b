// POST /prefill-state's logic (apps/provider/state_prefill.h): the body's refusals, the
// binding checked against the server's model before any compute, and a payload whose state
// is the file route's state file for the ids.
#include "apps/provider/state_prefill.h"

#include <gtest/gtest.h>

#include <mutex>
#include <nlohmann/json.hpp>

#include "apps/provider/prefill_routes.h"
#include "kvshare/statefile/state_file_reader.h"
#include "layout/memory_shape.h"
#include "layout/remote_state_payload.h"
#include "layout/share_header.h"
#include "refmodel/model_generator.h"
#include "support/test_support.h"

namespace kvshare::refmodel {
namespace {

using Json = nlohmann::json;
using kvshare::testing::TempDir;

const std::vector<int32_t> kIds = {5, 17, 3, 42, 8};

std::filesystem::path write_model(const TempDir& dir, const GeneratorOptions& o, const std::string& name) {
  auto bytes = generate_model_bytes(o);
  EXPECT_TRUE(bytes);
  kvshare::testing::write_file_bytes(dir / name, *bytes);
  return dir / name;
}

class StatePrefill : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = write_model(dir_, {}, "m.gguf");
    auto loaded = load_provider_model(path_.string());
    ASSERT_TRUE(loaded) << loaded.error().what();
    model_ = *loaded;
    prefiller_ = std::make_unique<StatePrefiller>(model_.model, path_.string(), 1);
  }

  layout::RemoteStateBinding binding(const std::vector<int32_t>& ids = kIds) const {
    layout::RemoteStateBinding b;
    b.model = prefiller_->model_hash();
    b.tokenizer = prefiller_->tokenizer_hash();
    b.state_version = 3;
    b.n_tokens = static_cast<uint32_t>(ids.size());
    b.tokens_hash = layout::remote_state_hex(layout::remote_state_tokens_hash(ids));
    b.cache_type_k = "f16";
    b.cache_type_v = "f16";
    return b;
  }

  StatePrefillAnswer ask(const layout::RemoteStateBinding& b, const std::vector<int32_t>& ids = kIds) {
    const Json body = {{"tokens", ids}, {"binding", Json::parse(layout::remote_state_binding_json(b).dump())}};
    return prefiller_->answer(body.dump(), "", std::chrono::milliseconds(60000));
  }

  TempDir dir_;
  std::filesystem::path path_;
  ProviderModel model_;
  std::unique_ptr<StatePrefiller> prefiller_;
};

TEST_F(StatePrefill, AnswersAPayloadWhoseStateIsTheIdsStateFile) {
  const StatePrefillAnswer answer = ask(binding());
  ASSERT_EQ(answer.status, 200) << answer.body;
  EXPECT_EQ(answer.content_type, layout::kRemoteStateContentType);
  auto payload = layout::parse_remote_state(
      std::span(reinterpret_cast<const std::byte*>(answer.body.data()), answer.body.size()), "answer");
  ASSERT_TRUE(payload) << payload.error().what();
  EXPECT_EQ(payload->binding, binding());
  layout::KvParams params;
  params.n_ctx = 256;
  auto memory = layout::derive_memory_shape(model_.model->shape(), params);
  ASSERT_TRUE(memory);
  auto file = statefile::parse_state_bytes(std::vector<std::byte>(payload->state.begin(), payload->state.end()),
                                           &*memory, "payload state");
  ASSERT_TRUE(file) << file.error().what();
  EXPECT_EQ(file->tokens(), kIds);
  EXPECT_GT(answer.prefill_ms, 0);
}

TEST_F(StatePrefill, WritesTheAskedStateVersionAndTransposedV) {
  layout::RemoteStateBinding b = binding();
  b.state_version = 2;
  b.v_trans = true;
  const StatePrefillAnswer answer = ask(b);
  ASSERT_EQ(answer.status, 200) << answer.body;
  auto payload = layout::parse_remote_state(
      std::span(reinterpret_cast<const std::byte*>(answer.body.data()), answer.body.size()), "answer");
  ASSERT_TRUE(payload) << payload.error().what();
  EXPECT_EQ(payload->binding, b);
  // The state's version word (after its 4-byte magic).
  ASSERT_GT(payload->state.size(), 8u);
  EXPECT_EQ(static_cast<uint8_t>(payload->state[4]), 2);
}

TEST_F(StatePrefill, RefusesABindingForAnotherModelBeforeAnyCompute) {
  layout::RemoteStateBinding b = binding();
  b.model = "0x0000000000000001";
  const StatePrefillAnswer answer = ask(b);
  EXPECT_EQ(answer.status, 400);
  EXPECT_NE(answer.body.find("field \\\"model\\\""), std::string::npos) << answer.body;
  EXPECT_NE(answer.body.find(prefiller_->model_hash()), std::string::npos) << answer.body;
  EXPECT_NE(answer.body.find("give the provider server the decoder's model"), std::string::npos) << answer.body;
}

TEST_F(StatePrefill, RefusesABindingForAnotherTokenizer) {
  layout::RemoteStateBinding b = binding();
  b.tokenizer = "0x0000000000000002";
  const StatePrefillAnswer answer = ask(b);
  EXPECT_EQ(answer.status, 400);
  EXPECT_NE(answer.body.find("field \\\"tokenizer\\\""), std::string::npos) << answer.body;
}

TEST_F(StatePrefill, RefusesABindingThatIsNotForTheBodysIds) {
  const StatePrefillAnswer answer = ask(binding({5, 17, 3, 42, 9}));
  EXPECT_EQ(answer.status, 400);
  EXPECT_NE(answer.body.find("binding.tokens_hash"), std::string::npos) << answer.body;
}

TEST_F(StatePrefill, RefusesAnIdOutsideTheVocabulary) {
  const std::vector<int32_t> ids = {5, 1000000};
  const StatePrefillAnswer answer = ask(binding(ids), ids);
  EXPECT_EQ(answer.status, 400);
  EXPECT_NE(answer.body.find("outside the vocabulary"), std::string::npos) << answer.body;
}

TEST_F(StatePrefill, RefusesSlotsOutsideWhatADecoderHasNamingTheField) {
  Json body = {{"tokens", kIds}, {"binding", Json::parse(layout::remote_state_binding_json(binding()).dump())}};
  body["parallel"] = 0;
  StatePrefillAnswer answer = prefiller_->answer(body.dump(), "", std::chrono::milliseconds(60000));
  EXPECT_EQ(answer.status, 400);
  EXPECT_NE(answer.body.find("\\\"parallel\\\" is 0, expected the decoder's slots, 1..256"), std::string::npos)
      << answer.body;
  body["parallel"] = 4;
  body["kv_unified"] = "yes";
  answer = prefiller_->answer(body.dump(), "", std::chrono::milliseconds(60000));
  EXPECT_EQ(answer.status, 400);
  EXPECT_NE(answer.body.find("\\\"kv_unified\\\" is \\\"yes\\\", expected true or false"), std::string::npos)
      << answer.body;
}

TEST_F(StatePrefill, WritesOneStreamPerSlotForSeveralSlots) {
  Json body = {{"tokens", kIds}, {"binding", Json::parse(layout::remote_state_binding_json(binding()).dump())}};
  body["parallel"] = 4;
  const StatePrefillAnswer answer = prefiller_->answer(body.dump(), "", std::chrono::milliseconds(60000));
  ASSERT_EQ(answer.status, 200) << answer.body;
  auto payload = layout::parse_remote_state(
      std::span(reinterpret_cast<const std::byte*>(answer.body.data()), answer.body.size()), "answer");
  ASSERT_TRUE(payload) << payload.error().what();
  // The same ids' file, as a decoder with -np 4 (one stream per slot) reads it.
  layout::KvParams params;
  params.n_ctx = 1024;
  params.n_seq_max = 4;
  params.kv_unified = false;
  auto memory = layout::derive_memory_shape(model_.model->shape(), params);
  ASSERT_TRUE(memory) << memory.error().what();
  auto file = statefile::parse_state_bytes(std::vector<std::byte>(payload->state.begin(), payload->state.end()),
                                           &*memory, "payload state");
  ASSERT_TRUE(file) << file.error().what();
  EXPECT_EQ(file->tokens(), kIds);
}

TEST(StatePrefillBody, RefusesABodyWithoutABinding) {
  auto body = parse_state_prefill_body(R"({"tokens": [1, 2]})");
  ASSERT_FALSE(body);
  EXPECT_EQ(body.error().errno_value(), EINVAL);
  EXPECT_NE(body.error().message().find("no \"binding\""), std::string::npos);
}

TEST(StatePrefillBody, RefusesDeepNestingBeforeParsing) {
  auto body = parse_state_prefill_body(std::string(100, '[') + std::string(100, ']'));
  ASSERT_FALSE(body);
  EXPECT_NE(body.error().message().find("nests deeper"), std::string::npos);
}

TEST(StatePrefillBody, RefusesANegativeId) {
  auto body = parse_state_prefill_body(R"({"tokens": [1, -2], "binding": {}})");
  ASSERT_FALSE(body);
  EXPECT_NE(body.error().message().find("tokens[1] is -2"), std::string::npos);
}

}  // namespace
}  // namespace kvshare::refmodel
