#include "layout/share_header.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "layout/shape_fixtures.h"
#include "support/test_support.h"

namespace kvshare::layout {
namespace {

using Json = nlohmann::ordered_json;

std::string read_vector(const std::string& name) {
  const auto bytes = kvshare::testing::read_file_bytes(kvshare::testing::data_path(name));
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

ModelFingerprint example_fingerprint() {
  ModelFingerprint fp;
  fp.arch = "llama";
  fp.name = "kvshare worked example";
  fp.n_layer = 2;
  fp.n_embd = 256;
  fp.tensors_hash = 0xcbf29ce484222325ull;  // no tensor infos: the FNV-1a basis
  return fp;
}

ShareHeader example_header(KvParams params = [] {
  KvParams p;
  p.n_ctx = 512;
  return p;
}()) {
  auto model = derive_model_shape(testing::worked_example_model().metadata());
  EXPECT_TRUE(model.has_value());
  auto header = make_share_header(example_fingerprint(), *model, params);
  EXPECT_TRUE(header.has_value()) << header.error().what();
  return *header;
}

// Parses `json`, expecting failure; returns the message.
std::string parse_error(const std::string& json) {
  auto header = parse_share_header(json, "peer.json");
  EXPECT_FALSE(header.has_value());
  if (header) return "";
  EXPECT_EQ(header.error().errno_value() != 0, true);
  return header.error().message();
}

// The example document with one edit applied.
std::string edited(const std::function<void(Json&)>& edit) {
  Json j = Json::parse(read_vector("layout-example.json"));
  edit(j);
  return j.dump(2);
}

TEST(ShareHeader, DecodesTheWorkedExampleFieldByField) {
  auto header = parse_share_header(read_vector("layout-example.json"), "layout-example.json");
  ASSERT_TRUE(header.has_value()) << header.error().what();
  EXPECT_EQ(header->format_version, 1u);
  EXPECT_EQ(header->model, example_fingerprint());
  EXPECT_EQ(header->params.n_ctx, 512u);
  EXPECT_EQ(header->params.n_seq_max, 1u);
  EXPECT_TRUE(header->params.kv_unified);
  EXPECT_EQ(header->params.type_k, GgmlType::F16);
  EXPECT_EQ(header->params.type_v, GgmlType::F16);
  EXPECT_TRUE(header->params.flash_attn);
  EXPECT_FALSE(header->params.swa_full);
  EXPECT_EQ(header->params.n_ubatch, 512u);
  EXPECT_EQ(header->memory.kind, MemoryKind::kv);
  EXPECT_EQ(header->memory.n_ctx, 512u);
  EXPECT_EQ(header->memory.n_ctx_seq, 512u);
  EXPECT_EQ(header->memory.n_pos_per_embd, 1u);
  ASSERT_EQ(header->memory.kv_caches.size(), 1u);
  const KvCacheShape& cache = header->memory.kv_caches[0];
  EXPECT_EQ(cache.role, "kv");
  EXPECT_EQ(cache.kv_size, 512u);
  EXPECT_EQ(cache.n_stream, 1u);
  EXPECT_FALSE(cache.v_trans);
  ASSERT_EQ(cache.layers.size(), 2u);
  EXPECT_EQ(cache.layers[1].il, 1u);
  EXPECT_EQ(cache.layers[1].n_embd_k_gqa, 128u);
  EXPECT_EQ(cache.tensors.size(), 4u);
  EXPECT_FALSE(header->memory.recurrent.has_value());
  ASSERT_EQ(header->layout.chunks.size(), 1u);
  EXPECT_EQ(header->layout.chunks[0].size_bytes, 524288u);
  EXPECT_EQ(header->layout.chunks[0].layout_hash, 0xc152419dd99b2d2full);
  ASSERT_EQ(header->layout.tensors.size(), 4u);
  const SharedTensor& v1 = header->layout.tensors[3];
  EXPECT_EQ(v1.tensor.name, "cache_v_l1");
  EXPECT_EQ(v1.tensor.layer, 1u);
  EXPECT_EQ(v1.tensor.kind, TensorKind::v);
  EXPECT_EQ(v1.tensor.type, GgmlType::F16);
  EXPECT_EQ(v1.tensor.ne, (std::array<int64_t, 4>{128, 512, 1, 1}));
  EXPECT_EQ(v1.tensor.row_bytes, 256u);
  EXPECT_EQ(v1.tensor.nbytes, 131072u);
  EXPECT_EQ(v1.chunk, 0u);
  EXPECT_EQ(v1.offset, 393216u);
  EXPECT_EQ(v1.padded_bytes, 131072u);
}

TEST(ShareHeader, ReencodesTheWorkedExampleToTheSameBytes) {
  const std::string bytes = read_vector("layout-example.json");
  auto header = parse_share_header(bytes, "layout-example.json");
  ASSERT_TRUE(header.has_value()) << header.error().what();
  EXPECT_EQ(to_json(*header), bytes);
}

TEST(ShareHeader, MakesTheWorkedExampleFromTheModelAndParams) {
  EXPECT_EQ(to_json(example_header()), read_vector("layout-example.json"));
}

TEST(ShareHeader, RoundTripsCompactJson) {
  const ShareHeader header = example_header();
  auto parsed = parse_share_header(to_json(header, false), "handshake from pid 1");
  ASSERT_TRUE(parsed.has_value()) << parsed.error().what();
  EXPECT_EQ(to_json(*parsed, false), to_json(header, false));
}

TEST(ShareHeader, RoundTripsIswaAndHybridMemory) {
  auto gemma = testing::transformer("gemma3", 6, 1024, 4, 1);
  gemma.u32("attention.sliding_window", 512);
  auto qwen3next = testing::transformer("qwen3next", 4, 2048, 16, 2);
  qwen3next.u32("ssm.conv_kernel", 4)
      .u32("ssm.inner_size", 4096)
      .u32("ssm.state_size", 128)
      .u32("ssm.time_step_rank", 32)
      .u32("ssm.group_count", 16);
  for (const auto* builder : {&gemma, &qwen3next}) {
    auto model = derive_model_shape(builder->metadata());
    ASSERT_TRUE(model.has_value()) << model.error().what();
    KvParams params;
    params.n_ctx = 2048;
    params.n_seq_max = 2;
    params.kv_unified = false;
    params.flash_attn = false;
    auto header = make_share_header(ModelFingerprint{model->arch}, *model, params);
    ASSERT_TRUE(header.has_value()) << header.error().what();
    auto parsed = parse_share_header(to_json(*header), "round trip");
    ASSERT_TRUE(parsed.has_value()) << parsed.error().what();
    EXPECT_EQ(to_json(*parsed), to_json(*header)) << model->arch;
    EXPECT_EQ(parsed->memory.kv_caches.size(), header->memory.kv_caches.size());
    EXPECT_EQ(parsed->memory.recurrent.has_value(), header->memory.recurrent.has_value());
  }
}

TEST(ShareHeader, NamesTheSourceWhenTheTextIsNotJson) {
  const std::string message = parse_error("{\"format\": ");
  EXPECT_NE(message.find("peer.json"), std::string::npos) << message;
  EXPECT_NE(message.find("not valid JSON"), std::string::npos) << message;
}

TEST(ShareHeader, RefusesANewerFormatVersionWithAnUpgradeHint) {
  const std::string message = parse_error(edited([](Json& j) { j["format_version"] = 2; }));
  EXPECT_NE(message.find("\"format_version\" is 2"), std::string::npos) << message;
  EXPECT_NE(message.find("newer"), std::string::npos) << message;
}

TEST(ShareHeader, RefusesADocumentOfAnotherFormat) {
  const std::string message = parse_error(edited([](Json& j) { j["format"] = "gguf"; }));
  EXPECT_NE(message.find("\"format\""), std::string::npos) << message;
}

TEST(ShareHeader, NamesAMissingField) {
  const std::string message = parse_error(edited([](Json& j) { j["params"].erase("type_k"); }));
  EXPECT_NE(message.find("field \"params.type_k\" is missing"), std::string::npos) << message;
}

TEST(ShareHeader, NamesAWronglyTypedField) {
  const std::string message = parse_error(edited([](Json& j) { j["memory"]["n_ctx"] = "512"; }));
  EXPECT_NE(message.find("field \"memory.n_ctx\""), std::string::npos) << message;
  EXPECT_NE(message.find("expected an unsigned integer"), std::string::npos) << message;
}

TEST(ShareHeader, NamesANegativeOrOversizedNumber) {
  EXPECT_NE(parse_error(edited([](Json& j) { j["params"]["n_ctx"] = -1; })).find("params.n_ctx"), std::string::npos);
  EXPECT_NE(parse_error(edited([](Json& j) { j["params"]["n_ctx"] = 1ull << 33; })).find("at most 4294967295"),
            std::string::npos);
}

TEST(ShareHeader, RefusesAnUnknownCacheType) {
  const std::string message = parse_error(edited([](Json& j) { j["params"]["type_k"] = "q4_K"; }));
  EXPECT_NE(message.find("params.type_k"), std::string::npos) << message;
}

TEST(ShareHeader, RefusesAnUnalignedTensorOffset) {
  const std::string message = parse_error(edited([](Json& j) { j["tensors"][1]["offset"] = 131073; }));
  EXPECT_NE(message.find("tensors[1]"), std::string::npos) << message;
  EXPECT_NE(message.find("multiple of 4096"), std::string::npos) << message;
}

TEST(ShareHeader, RefusesATensorPastTheEndOfItsChunk) {
  const std::string message = parse_error(edited([](Json& j) { j["tensors"][3]["offset"] = 524288; }));
  EXPECT_NE(message.find("tensors[3]"), std::string::npos) << message;
  EXPECT_NE(message.find("past the end of chunk 0"), std::string::npos) << message;
}

TEST(ShareHeader, RecomputesTheChunkHash) {
  const std::string message =
      parse_error(edited([](Json& j) { j["chunks"][0]["layout_hash"] = "0x0000000000000001"; }));
  EXPECT_NE(message.find("chunks[0].layout_hash"), std::string::npos) << message;
  EXPECT_NE(message.find("0xc152419dd99b2d2f"), std::string::npos) << message;
}

TEST(ShareHeader, RefusesTensorsThatOverlap) {
  const std::string message = parse_error(edited([](Json& j) { j["tensors"][2]["offset"] = 131072; }));
  EXPECT_NE(message.find("tensors[2]"), std::string::npos) << message;
  EXPECT_NE(message.find("262144"), std::string::npos) << message;
}

TEST(ShareHeader, RefusesASizeThatDisagreesWithTypeAndShape) {
  const std::string message = parse_error(edited([](Json& j) { j["tensors"][0]["nbytes"] = 4096; }));
  EXPECT_NE(message.find("tensors[0]"), std::string::npos) << message;
  EXPECT_NE(message.find("131072"), std::string::npos) << message;
}

TEST(ShareHeader, RefusesATensorWhoseShapeDisagreesWithItsCache) {
  const std::string message = parse_error(edited([](Json& j) {
    j["tensors"][0]["ne"][1] = 256;
    j["tensors"][0]["nbytes"] = 65536;
    j["tensors"][0]["padded_bytes"] = 65536;
  }));
  EXPECT_NE(message.find("tensors[0].ne"), std::string::npos) << message;
  EXPECT_NE(message.find("kv_size 512"), std::string::npos) << message;
}

// A recurrent layer's width in memory.recurrent was never checked against its tensors: a
// header with n_embd_s altered was taken (issue 26), though a provider sizes its writes by it.
TEST(ShareHeader, RefusesARecurrentLayerWidthThatDisagreesWithItsTensors) {
  auto mamba2 = testing::transformer("mamba2", 2, 256, 0, 0);
  mamba2.u32("ssm.conv_kernel", 4)
      .u32("ssm.inner_size", 512)
      .u32("ssm.state_size", 16)
      .u32("ssm.time_step_rank", 8)
      .u32("ssm.group_count", 1);
  auto model = derive_model_shape(mamba2.metadata());
  ASSERT_TRUE(model.has_value()) << model.error().what();
  auto header = make_share_header(ModelFingerprint{model->arch}, *model, KvParams{});
  ASSERT_TRUE(header.has_value()) << header.error().what();
  Json j = Json::parse(to_json(*header));
  ASSERT_TRUE(parse_share_header(j.dump(), "unaltered").has_value());
  j["memory"]["recurrent"]["layers"][0]["n_embd_s"] =
      j["memory"]["recurrent"]["layers"][0]["n_embd_s"].get<uint32_t>() + 4;
  const std::string message = parse_error(j.dump());
  EXPECT_NE(message.find("memory.recurrent.layers[0].n_embd_s"), std::string::npos) << message;
  EXPECT_NE(message.find("cache_s_l0"), std::string::npos) << message;
}

TEST(ShareHeader, RefusesAHashThatIsNotSixteenHexDigits) {
  const std::string message = parse_error(edited([](Json& j) { j["model"]["tensors_hash"] = 12345; }));
  EXPECT_NE(message.find("model.tensors_hash"), std::string::npos) << message;
}

TEST(ShareHeader, RefusesDeepNestingBeforeParsing) {
  const std::string message = parse_error(std::string(100000, '[') + std::string(100000, ']'));
  EXPECT_NE(message.find("levels deep"), std::string::npos) << message;
}

TEST(ShareHeader, RefusesACacheCountTheMemoryKindCannotHave) {
  const std::string message = parse_error(edited([](Json& j) { j["memory"]["kind"] = "kv_iswa"; }));
  EXPECT_NE(message.find("memory.kv_caches"), std::string::npos) << message;
}

TEST(ShareHeader, RefusesAQuantizedVWithoutFlashAttention) {
  const std::string message = parse_error(edited([](Json& j) {
    j["params"]["type_v"] = "q8_0";
    j["params"]["flash_attn"] = false;
  }));
  EXPECT_NE(message.find("field \"params\""), std::string::npos) << message;
  EXPECT_NE(message.find("-ctv q8_0"), std::string::npos) << message;
}

TEST(CheckCompatible, AcceptsAnIdenticalHeader) {
  EXPECT_TRUE(check_compatible(example_header(), example_header(), "peer").has_value());
}

TEST(CheckCompatible, NamesTheFirstDifferingFieldWithBothValues) {
  KvParams params;
  params.n_ctx = 512;
  params.type_k = GgmlType::Q8_0;
  auto result = check_compatible(example_header(), example_header(params), "handshake from pid 4121");
  ASSERT_FALSE(result.has_value());
  EXPECT_EQ(result.error().message(),
            "handshake from pid 4121: field \"params.type_k\" is \"q8_0\", this provider uses \"f16\"");
  // A decoder checking a provider's header says so.
  auto from_decoder = check_compatible(example_header(), example_header(params), "provider pid 7", "decoder");
  ASSERT_FALSE(from_decoder.has_value());
  EXPECT_NE(from_decoder.error().message().find("this decoder uses \"f16\""), std::string::npos);
}

TEST(CheckCompatible, CatchesAFlashAttentionMismatchTheHashCannotSee) {
  KvParams params;
  params.n_ctx = 512;
  params.flash_attn = false;
  const ShareHeader theirs = example_header(params);
  // Every V has the same width, so the layout hashes agree although V is transposed.
  EXPECT_EQ(theirs.layout.chunks[0].layout_hash, example_header().layout.chunks[0].layout_hash);
  auto result = check_compatible(example_header(), theirs, "peer");
  ASSERT_FALSE(result.has_value());
  EXPECT_NE(result.error().message().find("params.flash_attn"), std::string::npos) << result.error().message();
}

TEST(CheckCompatible, AcceptsContextsThatPadToTheSameCache) {
  KvParams params;
  params.n_ctx = 300;  // pads to 512 like the example's 512
  EXPECT_TRUE(check_compatible(example_header(), example_header(params), "peer").has_value());
}

TEST(CheckCompatible, IgnoresKvUnifiedForASingleSequence) {
  KvParams params;
  params.n_ctx = 512;
  params.kv_unified = false;
  EXPECT_TRUE(check_compatible(example_header(), example_header(params), "peer").has_value());
  params.n_seq_max = 2;
  auto result = check_compatible(example_header(), example_header(params), "peer");
  ASSERT_FALSE(result.has_value());
  EXPECT_NE(result.error().message().find("params.n_seq_max"), std::string::npos) << result.error().message();
}

TEST(CheckCompatible, RefusesADifferentModel) {
  ShareHeader theirs = example_header();
  theirs.model.tensors_hash ^= 1;
  auto result = check_compatible(example_header(), theirs, "peer");
  ASSERT_FALSE(result.has_value());
  EXPECT_NE(result.error().message().find("model.tensors_hash"), std::string::npos);
}

TEST(ModelFingerprint, ReadsIdentityKeysAndHashesTensorInfos) {
  auto builder = testing::worked_example_model();
  GgufMetadata metadata = builder.metadata();
  metadata.set("general.name", GgufValue{std::string("tiny")});
  GgufArray tokens;
  tokens.element_type = GgufValueType::STRING;
  tokens.elements.assign(3, GgufValue{std::string("t")});
  metadata.set("tokenizer.ggml.tokens", GgufValue{tokens});
  GgufTensorInfo info;
  info.name = "a";
  info.n_dims = 1;
  info.ne = {2, 1, 1, 1};
  info.type = GgmlType::F32;
  const ModelFingerprint fp = model_fingerprint(metadata, {info});
  EXPECT_EQ(fp.arch, "llama");
  EXPECT_EQ(fp.name, "tiny");
  EXPECT_EQ(fp.n_layer, 2u);
  EXPECT_EQ(fp.n_embd, 256u);
  EXPECT_EQ(fp.n_vocab, 3u);
  // FNV-1a over u64 name length 1, "a", u32 type 0, i64 ne 2,1,1,1 (all little-endian),
  // computed separately with Python.
  EXPECT_EQ(fp.tensors_hash, 0xfe720cb36918056cull);
  info.ne[0] = 4;
  EXPECT_NE(model_fingerprint(metadata, {info}).tensors_hash, fp.tensors_hash);
}

}  // namespace
}  // namespace kvshare::layout
