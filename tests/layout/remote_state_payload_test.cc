#include "layout/remote_state_payload.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "layout/gguf_value.h"
#include "layout/share_header.h"
#include "support/test_support.h"

namespace kvshare::layout {
namespace {

using Json = nlohmann::json;

const std::vector<int32_t> kVectorIds = {39, 72, 106, 105, 0};

// The binding tests/data/make_remote_state_vector.py wrote into remote-state-v1.bin.
RemoteStateBinding vector_binding() {
  RemoteStateBinding b;
  b.model = "0x4d6f64656c2d6670";
  b.tokenizer = "0x546f6b656e697a72";
  b.state_version = 3;
  b.n_tokens = 5;
  b.tokens_hash = remote_state_hex(remote_state_tokens_hash(kVectorIds));
  b.cache_type_k = "f16";
  b.cache_type_v = "f16";
  b.v_trans = false;
  return b;
}

std::vector<std::byte> vector_bytes() {
  return kvshare::testing::read_file_bytes(kvshare::testing::data_path("remote-state-v1.bin"));
}

void put_u32(std::vector<std::byte>& bytes, size_t offset, uint32_t value) {
  for (int i = 0; i < 4; ++i) bytes[offset + i] = static_cast<std::byte>((value >> (8 * i)) & 0xff);
}

TEST(RemoteStatePayload, DecodesTheVectorFieldByFieldAndReencodesItByteEqual) {
  const std::vector<std::byte> bytes = vector_bytes();
  auto payload = parse_remote_state(bytes, "remote-state-v1.bin");
  ASSERT_TRUE(payload) << payload.error().what();
  EXPECT_EQ(payload->version, 1);
  const RemoteStateBinding& b = payload->binding;
  EXPECT_EQ(b.model, "0x4d6f64656c2d6670");
  EXPECT_EQ(b.tokenizer, "0x546f6b656e697a72");
  EXPECT_EQ(b.state_version, 3u);
  EXPECT_EQ(b.n_tokens, 5u);
  EXPECT_EQ(b.tokens_hash, "0x1752ff22dd993129");
  EXPECT_EQ(b.cache_type_k, "f16");
  EXPECT_EQ(b.cache_type_v, "f16");
  EXPECT_FALSE(b.v_trans);
  EXPECT_EQ(b, vector_binding());
  const std::vector<std::byte> state =
      kvshare::testing::read_file_bytes(kvshare::testing::data_path("state-v3-dense-f16.bin"));
  ASSERT_EQ(payload->state.size(), state.size());
  EXPECT_EQ(std::memcmp(payload->state.data(), state.data(), state.size()), 0);
  EXPECT_EQ(encode_remote_state(payload->binding, payload->state), bytes);
}

TEST(RemoteStatePayload, HashesTheIdsAsFnv1aOverLittleEndianInt32) {
  // FNV-1a 64 of no bytes is its basis; one id is its four bytes.
  EXPECT_EQ(remote_state_tokens_hash({}), 0xcbf29ce484222325ull);
  uint64_t h = 0xcbf29ce484222325ull;
  for (uint8_t byte : {0x27, 0x00, 0x00, 0x00}) h = (h ^ byte) * 1099511628211ull;
  EXPECT_EQ(remote_state_tokens_hash(std::vector<int32_t>{39}), h);
}

TEST(RemoteStatePayload, RefusesAnotherMagic) {
  std::vector<std::byte> bytes = vector_bytes();
  bytes[3] = std::byte{'Q'};
  auto payload = parse_remote_state(bytes, "reply");
  ASSERT_FALSE(payload);
  EXPECT_EQ(payload.error().errno_value(), EINVAL);
  EXPECT_NE(payload.error().message().find("magic"), std::string::npos) << payload.error().message();
  EXPECT_NE(payload.error().message().find("offset 0"), std::string::npos);
}

TEST(RemoteStatePayload, RefusesAnotherVersionNamingIt) {
  std::vector<std::byte> bytes = vector_bytes();
  bytes[4] = std::byte{2};
  auto payload = parse_remote_state(bytes, "reply");
  ASSERT_FALSE(payload);
  EXPECT_EQ(payload.error().errno_value(), EINVAL);
  EXPECT_NE(payload.error().message().find("payload version 2"), std::string::npos) << payload.error().message();
}

TEST(RemoteStatePayload, RefusesATruncatedPayloadAtEveryLength) {
  const std::vector<std::byte> bytes = vector_bytes();
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto payload = parse_remote_state(std::span(bytes.data(), n), "reply");
    ASSERT_FALSE(payload) << n;
    EXPECT_EQ(payload.error().errno_value(), EPROTO) << n << ": " << payload.error().message();
  }
  auto payload = parse_remote_state(std::span(bytes.data(), bytes.size() - 1), "reply");
  EXPECT_NE(payload.error().message().find("truncated"), std::string::npos) << payload.error().message();
}

TEST(RemoteStatePayload, RefusesTrailingBytes) {
  std::vector<std::byte> bytes = vector_bytes();
  bytes.push_back(std::byte{0});
  auto payload = parse_remote_state(bytes, "reply");
  ASSERT_FALSE(payload);
  EXPECT_EQ(payload.error().errno_value(), EPROTO);
  EXPECT_NE(payload.error().message().find("trailing bytes"), std::string::npos) << payload.error().message();
}

TEST(RemoteStatePayload, RefusesAnOversizeBindingBeforeReadingIt) {
  std::vector<std::byte> bytes = vector_bytes();
  put_u32(bytes, 8, 0xffffffffu);
  auto payload = parse_remote_state(bytes, "reply");
  ASSERT_FALSE(payload);
  EXPECT_EQ(payload.error().errno_value(), EMSGSIZE);
  EXPECT_NE(payload.error().message().find("binding_bytes at offset 8 is 4294967295"), std::string::npos)
      << payload.error().message();
}

TEST(RemoteStatePayload, RefusesAnOversizeStateBeforeReadingIt) {
  std::vector<std::byte> bytes = vector_bytes();
  for (int i = 0; i < 8; ++i) bytes[12 + i] = std::byte{0xff};
  auto payload = parse_remote_state(bytes, "reply");
  ASSERT_FALSE(payload);
  EXPECT_EQ(payload.error().errno_value(), EMSGSIZE);
  EXPECT_NE(payload.error().message().find("state_bytes at offset 12"), std::string::npos) << payload.error().message();
}

TEST(RemoteStatePayload, RefusesADeeplyNestedBindingWithoutParsingIt) {
  const std::string deep = std::string(1000, '[') + std::string(1000, ']');
  std::string prefix = encode_remote_state_prefix(vector_binding(), 1);
  std::vector<std::byte> bytes(20);
  std::memcpy(bytes.data(), prefix.data(), 20);
  put_u32(bytes, 8, static_cast<uint32_t>(deep.size()));
  for (char c : deep) bytes.push_back(static_cast<std::byte>(c));
  bytes.push_back(std::byte{0});
  auto payload = parse_remote_state(bytes, "reply");
  ASSERT_FALSE(payload);
  EXPECT_EQ(payload.error().errno_value(), EINVAL);
  EXPECT_NE(payload.error().message().find("nests deeper"), std::string::npos) << payload.error().message();
}

TEST(RemoteStatePayload, RefusesABindingWithoutAFieldNamingIt) {
  Json j = Json::parse(remote_state_binding_json(vector_binding()).dump());
  j.erase("tokenizer");
  auto binding = parse_remote_state_binding(j, "reply");
  ASSERT_FALSE(binding);
  EXPECT_EQ(binding.error().errno_value(), EINVAL);
  EXPECT_NE(binding.error().message().find("no field \"tokenizer\""), std::string::npos);
}

TEST(RemoteStatePayload, RefusesAnUnknownStateVersionAndCacheType) {
  Json j = Json::parse(remote_state_binding_json(vector_binding()).dump());
  j["state_version"] = 4;
  auto binding = parse_remote_state_binding(j, "reply");
  ASSERT_FALSE(binding);
  EXPECT_NE(binding.error().message().find("\"state_version\" is 4"), std::string::npos);
  j["state_version"] = 2;
  j["cache_type_v"] = "q3_K";
  binding = parse_remote_state_binding(j, "reply");
  ASSERT_FALSE(binding);
  EXPECT_NE(binding.error().message().find("\"cache_type_v\""), std::string::npos) << binding.error().message();
}

TEST(CheckBinding, AcceptsTheSameBinding) { EXPECT_TRUE(check_binding(vector_binding(), vector_binding(), "p")); }

TEST(CheckBinding, RefusesAnotherModelNamingBothAndTheFix) {
  RemoteStateBinding got = vector_binding();
  got.model = "0x0000000000000001";
  auto ok = check_binding(vector_binding(), got, "the provider server http://h:1");
  ASSERT_FALSE(ok);
  EXPECT_EQ(ok.error().errno_value(), EINVAL);
  EXPECT_NE(ok.error().message().find("field \"model\": the remote state is for model 0x0000000000000001, this "
                                      "decoder runs 0x4d6f64656c2d6670: give the provider server the decoder's model"),
            std::string::npos)
      << ok.error().message();
}

TEST(CheckBinding, RefusesAnotherTokenizer) {
  RemoteStateBinding got = vector_binding();
  got.tokenizer = "0x0000000000000002";
  auto ok = check_binding(vector_binding(), got, "p");
  ASSERT_FALSE(ok);
  EXPECT_EQ(ok.error().errno_value(), EINVAL);
  EXPECT_NE(ok.error().message().find("field \"tokenizer\""), std::string::npos);
  EXPECT_NE(ok.error().message().find("0x0000000000000002"), std::string::npos);
  EXPECT_NE(ok.error().message().find("the decoder's tokenizer"), std::string::npos);
}

TEST(CheckBinding, RefusesAnotherStateVersion) {
  RemoteStateBinding got = vector_binding();
  got.state_version = 2;
  auto ok = check_binding(vector_binding(), got, "p");
  ASSERT_FALSE(ok);
  EXPECT_EQ(ok.error().errno_value(), EINVAL);
  EXPECT_NE(ok.error().message().find("field \"state_version\": the remote state is of version 2, this decoder "
                                      "restores version 3"),
            std::string::npos)
      << ok.error().message();
}

TEST(CheckBinding, RefusesAnotherTokenList) {
  RemoteStateBinding got = vector_binding();
  got.tokens_hash = remote_state_hex(remote_state_tokens_hash(std::vector<int32_t>{39, 72, 106, 105, 1}));
  auto ok = check_binding(vector_binding(), got, "p");
  ASSERT_FALSE(ok);
  EXPECT_EQ(ok.error().errno_value(), EINVAL);
  EXPECT_NE(ok.error().message().find("field \"tokens_hash\""), std::string::npos) << ok.error().message();
  got = vector_binding();
  got.n_tokens = 4;
  ok = check_binding(vector_binding(), got, "p");
  ASSERT_FALSE(ok);
  EXPECT_NE(ok.error().message().find("field \"n_tokens\": the remote state holds 4 tokens"), std::string::npos)
      << ok.error().message();
}

TEST(CheckBinding, RefusesOtherKvParams) {
  RemoteStateBinding got = vector_binding();
  got.cache_type_k = "q8_0";
  auto ok = check_binding(vector_binding(), got, "p");
  ASSERT_FALSE(ok);
  EXPECT_NE(ok.error().message().find("field \"cache_type_k\": the remote state's K cache is q8_0, this decoder runs "
                                      "-ctk f16"),
            std::string::npos)
      << ok.error().message();
  got = vector_binding();
  got.v_trans = true;
  ok = check_binding(vector_binding(), got, "p");
  ASSERT_FALSE(ok);
  EXPECT_NE(ok.error().message().find("field \"v_trans\""), std::string::npos);
  EXPECT_NE(ok.error().message().find("-fa off"), std::string::npos);
}

TEST(TokenizerFingerprint, ChangesWithTheTokensAndNotWithTheChatTemplate) {
  GgufMetadata a;
  a.set("tokenizer.ggml.model", GgufValue{std::string("gpt2")});
  GgufArray tokens;
  tokens.element_type = GgufValueType::STRING;
  tokens.elements = {GgufValue{std::string("a")}, GgufValue{std::string("b")}};
  a.set("tokenizer.ggml.tokens", GgufValue{tokens});
  GgufMetadata b = a;
  b.set("tokenizer.chat_template", GgufValue{std::string("{{ messages }}")});
  EXPECT_EQ(tokenizer_fingerprint(a), tokenizer_fingerprint(b));
  tokens.elements[1] = GgufValue{std::string("c")};
  b.set("tokenizer.ggml.tokens", GgufValue{tokens});
  EXPECT_NE(tokenizer_fingerprint(a), tokenizer_fingerprint(b));
  GgufMetadata c = a;
  c.set("tokenizer.ggml.add_bos_token", GgufValue{true});
  EXPECT_NE(tokenizer_fingerprint(a), tokenizer_fingerprint(c));
}

TEST(ModelFingerprintHash, ChangesWithEveryField) {
  ModelFingerprint fp;
  fp.arch = "qwen3";
  const uint64_t base = model_fingerprint_hash(fp);
  ModelFingerprint other = fp;
  other.tensors_hash = 1;
  EXPECT_NE(model_fingerprint_hash(other), base);
  other = fp;
  other.n_layer = 3;
  EXPECT_NE(model_fingerprint_hash(other), base);
  other = fp;
  other.name = "x";
  EXPECT_NE(model_fingerprint_hash(other), base);
}

}  // namespace
}  // namespace kvshare::layout
