#include "kvshare/statefile/state_tools.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <random>
#include <tuple>

#include "kvshare/statefile/state_file_reader.h"
#include "kvshare/statefile/state_file_writer.h"
#include "layout/gguf_writer.h"
#include "layout/state_test_shapes.h"
#include "refmodel/model_generator.h"
#include "support/test_support.h"

namespace kvshare::statefile {
namespace {

using layout::GgmlType;
using layout::MemoryShape;
using layout::TensorKind;

class StateToolsTest : public kvshare::testing::FdLeakCheck {
 protected:
  // Writes a file for `shape` with random f32 rows (the same rows for every call and seed).
  std::filesystem::path write(const std::string& name, const MemoryShape& shape, uint32_t n_tokens, uint32_t seed = 3,
                              float scale = 1.0f) {
    const auto path = dir_ / name;
    std::vector<int32_t> tokens(n_tokens);
    for (uint32_t i = 0; i < n_tokens; ++i) tokens[i] = static_cast<int32_t>(i + 1);
    StateFileWriterOptions options;
    options.n_embd_head_k = options.n_embd_head_v = 64;
    auto writer = StateFileWriter::create(path, shape, tokens, static_cast<int32_t>(n_tokens), options);
    EXPECT_TRUE(writer) << writer.error().what();
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.0f, scale);
    for (const auto& block : writer->layout().blocks)
      for (const auto& stream : block.streams)
        for (const auto& section : stream.sections) {
          const uint32_t rows = section.kind == TensorKind::r || section.kind == TensorKind::s ? 1 : n_tokens;
          std::vector<float> values(uint64_t{rows} * section.n_embd);
          for (float& v : values) v = dist(rng);
          EXPECT_TRUE(writer->write_section(section.kind, section.il, RowsView{GgmlType::F32, values.data(), rows, 0}));
        }
    auto info = writer->commit();
    EXPECT_TRUE(info) << info.error().what();
    return path;
  }

  kvshare::testing::TempDir dir_;
};

TEST_F(StateToolsTest, InspectDescribesBlocksLayersAndStatistics) {
  const auto path = write("a.bin", testing::iswa_shape(8), 19);
  auto text = inspect_state_file(path, false);
  ASSERT_TRUE(text) << text.error().what();
  EXPECT_NE(text->find("14316 bytes"), std::string::npos) << *text;
  EXPECT_NE(text->find("kv_iswa"), std::string::npos) << *text;
  EXPECT_NE(text->find("8 cells, positions 11..18"), std::string::npos) << *text;
  EXPECT_NE(text->find("rms"), std::string::npos);
}

TEST_F(StateToolsTest, InspectJsonIsOneObjectWithEverySection) {
  const auto path = write("a.bin", testing::hybrid_shape(), 6);
  auto text = inspect_state_file(path, true);
  ASSERT_TRUE(text);
  const auto doc = nlohmann::json::parse(*text);
  EXPECT_EQ(doc["memory_kind"], "hybrid");
  EXPECT_EQ(doc["n_token"], 6);
  ASSERT_EQ(doc["blocks"].size(), 2u);
  EXPECT_EQ(doc["blocks"][0]["streams"][0]["sections"].size(), 4u);
  EXPECT_EQ(doc["blocks"][1]["streams"][0]["sections"].size(), 4u);
  EXPECT_EQ(doc["blocks"][1]["streams"][0]["pos_last"], 5);
  EXPECT_GT(doc["blocks"][0]["streams"][0]["sections"][0]["rms"].get<double>(), 0.5);
}

TEST_F(StateToolsTest, DiffOfAFileWithItselfIsZero) {
  const auto path = write("a.bin", testing::dense_shape(), 5);
  auto report = diff_state_files(path, path, 0.0, {});
  ASSERT_TRUE(report) << report.error().what();
  EXPECT_EQ(report->max_abs, 0.0);
  EXPECT_TRUE(report->within_tolerance);
}

TEST_F(StateToolsTest, DiffFlagsDifferentValuesPastTheTolerance) {
  const auto a = write("a.bin", testing::dense_shape(), 5, 3);
  const auto b = write("b.bin", testing::dense_shape(), 5, 4);
  auto report = diff_state_files(a, b, 0.01, {});
  ASSERT_TRUE(report) << report.error().what();
  EXPECT_FALSE(report->within_tolerance);
  EXPECT_NE(report->text.find("kv layer 1 V"), std::string::npos) << report->text;
  EXPECT_NE(report->text.find("EXCEEDS"), std::string::npos);
}

TEST_F(StateToolsTest, DiffRefusesFilesOfDifferentStructure) {
  const auto a = write("a.bin", testing::dense_shape(), 5);
  const auto b = write("b.bin", testing::dense_shape(), 6);
  auto report = diff_state_files(a, b, 1.0, {});
  ASSERT_FALSE(report);
  EXPECT_NE(report.error().message().find("different cells"), std::string::npos) << report.error().message();
}

// llama-server 80fb11ac's own save (version 3, the prompt packed by server_tokens::serialize)
// and libllama d32676d's (version 2, plain ids) of the same prompt: inspect reports the
// real ids of both, and diff reads one against the other.
TEST_F(StateToolsTest, InspectAndDiffReadLlamaServersPackedTokensAndPlainIds) {
  const std::vector<int32_t> ids{39, 72, 106, 105, 0};
  const auto packed = kvshare::testing::data_path("state-v3-dense-f16.bin");
  const auto plain = kvshare::testing::data_path("state-dense-f16.bin");
  for (const auto& [path, form, words] : {std::tuple{packed, "server_packed", 9}, std::tuple{plain, "ids", 5}}) {
    SCOPED_TRACE(path.filename().string());
    auto text = inspect_state_file(path, true);
    ASSERT_TRUE(text) << text.error().what();
    const auto doc = nlohmann::json::parse(*text);
    EXPECT_EQ(doc["token_form"], form);
    EXPECT_EQ(doc["n_token_words"], words);
    EXPECT_EQ(doc["n_token"], 5);
    EXPECT_EQ(doc["tokens"].get<std::vector<int32_t>>(), ids);
  }
  auto report = diff_state_files(packed, plain, 0.0, {});
  ASSERT_TRUE(report) << report.error().what();
  EXPECT_EQ(report->max_abs, 0.0);
  EXPECT_EQ(report->text.find("tokens differ"), std::string::npos) << report->text;
}

TEST_F(StateToolsTest, ConvertsF16ToQ8_0WithinQuantizationNoiseAndBack) {
  const auto f16 = write("f16.bin", testing::dense_shape(), 9);
  ConvertOptions to_q8;
  to_q8.type_k = to_q8.type_v = GgmlType::Q8_0;
  to_q8.rotation.n_embd_head_k = to_q8.rotation.n_embd_head_v = 64;
  auto info = convert_state_file(f16, dir_ / "q8.bin", to_q8);
  ASSERT_TRUE(info) << info.error().what();
  EXPECT_EQ(info->size_bytes, 12u + 36 + 8 + 108 + 8 + 4 * (12 + 9 * 136));

  const auto shape = testing::dense_shape(GgmlType::Q8_0, GgmlType::Q8_0);
  auto q8 = read_state_file(dir_ / "q8.bin", &shape);
  ASSERT_TRUE(q8) << q8.error().what();

  RotationInfo rotation{64, 64, false};
  auto report = diff_state_files(f16, dir_ / "q8.bin", 0.05, rotation);
  ASSERT_TRUE(report) << report.error().what();
  EXPECT_TRUE(report->within_tolerance) << report->text;
  EXPECT_GT(report->max_abs, 0.0);
  // Without undoing the rotation the values are unrelated: the diff must say so.
  auto unrotated = diff_state_files(f16, dir_ / "q8.bin", 0.05, RotationInfo{0, 0, true});
  ASSERT_TRUE(unrotated);
  EXPECT_FALSE(unrotated->within_tolerance);
}

TEST_F(StateToolsTest, ConvertKeepsUnchangedSectionsByteForByte) {
  const auto f16 = write("f16.bin", testing::dense_shape(), 4);
  ConvertOptions same;
  auto info = convert_state_file(f16, dir_ / "same.bin", same);
  ASSERT_TRUE(info) << info.error().what();
  EXPECT_EQ(kvshare::testing::read_file_bytes(f16), kvshare::testing::read_file_bytes(dir_ / "same.bin"));
}

TEST_F(StateToolsTest, ConvertsBetweenStateVersionsKeepingEveryOtherByte) {
  const auto v3 = write("v3.bin", testing::dense_shape(), 6);
  ConvertOptions to_v2;
  to_v2.type_k.reset();
  to_v2.type_v.reset();
  to_v2.to_version = layout::kStateSeqVersion2;
  auto info = convert_state_file(v3, dir_ / "v2.bin", to_v2);
  ASSERT_TRUE(info) << info.error().what();
  EXPECT_EQ(info->state_version, 2u);
  auto a = kvshare::testing::read_file_bytes(v3);
  auto b = kvshare::testing::read_file_bytes(dir_ / "v2.bin");
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(a[4], std::byte{3});
  EXPECT_EQ(b[4], std::byte{2});
  b[4] = std::byte{3};
  EXPECT_EQ(a, b);  // dense cells: the version word is the only difference
}

TEST_F(StateToolsTest, ConvertUnpacksLlamaServersTokensAndRewritesMropeCells) {
  // A version 3 file as llama-server 80fb11ac saves an M-RoPE slot: the prompt packed by
  // server_tokens::serialize, cells of 24 bytes with the token.
  auto shape = testing::dense_shape();
  shape.n_pos_per_embd = 4;
  const std::vector<int32_t> ids{5, 6, 7};
  const std::vector<int32_t> words{-1, 1, 3, 5, 6, 7, 0};
  auto planned = layout::plan_state_layout(shape, static_cast<uint32_t>(words.size()), 3, layout::kStateSeqVersion3);
  ASSERT_TRUE(planned);
  layout::set_cell_tokens(*planned, ids);
  std::vector<std::byte> rows(1 << 16, std::byte{0x3c});
  const auto file = layout::encode_state_file(*planned, words, [&](const layout::StateSection& section) {
    return std::span<const std::byte>(rows).first(section.data_bytes());
  });
  const auto packed = dir_ / "packed.bin";
  kvshare::testing::write_file_bytes(packed, file);

  auto read = read_state_file(packed, &shape);
  ASSERT_TRUE(read) << read.error().what();
  EXPECT_EQ(read->tokens(), ids);
  EXPECT_EQ(read->layout().token_form, layout::StateTokenForm::server_packed);

  ConvertOptions to_v2;
  to_v2.type_k.reset();
  to_v2.type_v.reset();
  to_v2.to_version = layout::kStateSeqVersion2;
  auto info = convert_state_file(packed, dir_ / "v2.bin", to_v2);
  ASSERT_TRUE(info) << info.error().what();
  auto v2 = read_state_file(dir_ / "v2.bin", &shape);
  ASSERT_TRUE(v2) << v2.error().what();
  EXPECT_EQ(v2->layout().version, 2u);
  EXPECT_EQ(v2->layout().token_form, layout::StateTokenForm::ids);
  EXPECT_EQ(v2->layout().n_token, 3u);
  EXPECT_EQ(v2->tokens(), ids);
  EXPECT_EQ(v2->layout().blocks[0].streams[0].cell_record_bytes, 20u);
  EXPECT_EQ(info->size_bytes, file.size() - 4 * 4 - 3 * 4);  // 4 token words and 3 ext.tok fewer

  ConvertOptions to_v3 = to_v2;
  to_v3.to_version = layout::kStateSeqVersion3;
  ASSERT_TRUE(convert_state_file(dir_ / "v2.bin", dir_ / "v3.bin", to_v3));
  auto v3 = read_state_file(dir_ / "v3.bin", &shape);
  ASSERT_TRUE(v3) << v3.error().what();
  EXPECT_EQ(v3->layout().blocks[0].streams[0].cells, read->layout().blocks[0].streams[0].cells);
  for (const auto* section : v3->sections()) {
    const auto* original = read->find_section(section->kind, section->il);
    ASSERT_NE(original, nullptr);
    const auto x = v3->section_bytes(*section), y = read->section_bytes(*original);
    EXPECT_TRUE(std::equal(x.begin(), x.end(), y.begin(), y.end()));
  }
}

TEST_F(StateToolsTest, ConvertRefusesAQuantizedTransposedV) {
  const auto path = write("t.bin", testing::dense_shape(GgmlType::F16, GgmlType::F16, true), 4);
  ConvertOptions options;
  options.type_v = GgmlType::Q8_0;
  options.rotation = {64, 64, false};
  auto info = convert_state_file(path, dir_ / "out.bin", options);
  ASSERT_FALSE(info);
  EXPECT_NE(info.error().message().find("needs flash attention"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(dir_ / "out.bin"));
}

TEST_F(StateToolsTest, ConvertNeedsTheHeadSizeForAQuantizedTarget) {
  const auto path = write("f.bin", testing::dense_shape(), 4);
  ConvertOptions options;
  options.type_k = GgmlType::Q8_0;
  auto info = convert_state_file(path, dir_ / "out.bin", options);
  ASSERT_FALSE(info);
  EXPECT_NE(info.error().message().find("head size"), std::string::npos) << info.error().message();
}

// Issue 26: inspect reported this LFM2 file as "recurrent: 1 cells x 1 layers" with 24
// trailing bytes; it holds n_layer 4, two R sections of 512 bytes and two S headers of 0.
TEST_F(StateToolsTest, InspectReadsAnLfm2FileAsTwoRecurrentLayersOfFourWithNothingTrailing) {
  const auto vector = kvshare::testing::data_path("state-v3-lfm2-hybrid.bin");
  auto text = inspect_state_file(vector, false);
  ASSERT_TRUE(text) << text.error().what();
  EXPECT_NE(text->find("recurrent: 1 cells x 2 recurrent of 4 layers (f32, R row 512 B, S row 0 B)"), std::string::npos)
      << *text;
  EXPECT_NE(text->find("2 of the 4 layers are recurrent"), std::string::npos) << *text;
  EXPECT_EQ(text->find("trailing"), std::string::npos) << *text;
  auto json = inspect_state_file(vector, true);
  ASSERT_TRUE(json) << json.error().what();
  const auto doc = nlohmann::json::parse(*json);
  EXPECT_EQ(doc["trailing_bytes"], 0);
  const auto& recurrent = doc["blocks"][1]["streams"][0];
  EXPECT_EQ(recurrent["n_layer"], 4);
  EXPECT_EQ(recurrent["n_recurrent_layers"], 2);
  ASSERT_EQ(recurrent["sections"].size(), 4u);
  EXPECT_EQ(recurrent["sections"][2]["kind"], "s");
  EXPECT_EQ(recurrent["sections"][2]["row_bytes"], 0);
}

TEST_F(StateToolsTest, DiffAndConvertKeepAnLfm2FilesRecurrentBlock) {
  const auto vector = kvshare::testing::data_path("state-v3-lfm2-hybrid.bin");
  auto same = diff_state_files(vector, vector, 0.0, RotationInfo{});
  ASSERT_TRUE(same) << same.error().what();
  EXPECT_TRUE(same->within_tolerance);
  EXPECT_NE(same->text.find("recurrent layer 1 S"), std::string::npos) << same->text;

  // Back and forth through version 2: the file llama.cpp would write comes back byte for byte.
  ConvertOptions options;
  options.type_k.reset();
  options.type_v.reset();
  options.to_version = 2;
  const auto v2 = dir_ / "lfm2-v2.bin";
  auto info = convert_state_file(vector, v2, options);
  ASSERT_TRUE(info) << info.error().what();
  options.to_version = 3;
  const auto v3 = dir_ / "lfm2-v3.bin";
  info = convert_state_file(v2, v3, options);
  ASSERT_TRUE(info) << info.error().what();
  EXPECT_EQ(kvshare::testing::read_file_bytes(v3), kvshare::testing::read_file_bytes(vector));

  // To q8_0: K/V change, the recurrent block (f32 R, empty S) goes over unchanged.
  options.type_k = options.type_v = GgmlType::Q8_0;
  options.rotation.n_embd_head_k = options.rotation.n_embd_head_v = 64;
  const auto q8 = dir_ / "lfm2-q8_0.bin";
  info = convert_state_file(vector, q8, options);
  ASSERT_TRUE(info) << info.error().what();
  auto converted = read_state_file(q8, nullptr);
  ASSERT_TRUE(converted) << converted.error().what();
  EXPECT_EQ(converted->layout().trailing_bytes, 0u);
  EXPECT_EQ(converted->sections().size(), 8u);
}

class StateVerifyTest : public StateToolsTest {
 protected:
  void SetUp() override {
    StateToolsTest::SetUp();
    refmodel::GeneratorOptions options;  // qwen3, 2 layers, 2 KV heads of 64: the worked example
    options.shape_only = true;
    auto bytes = refmodel::generate_model_bytes(options);
    ASSERT_TRUE(bytes) << bytes.error().what();
    model_ = dir_ / "tiny.gguf";
    kvshare::testing::write_file_bytes(model_, *bytes);
  }
  std::filesystem::path model_;
};

TEST_F(StateVerifyTest, AcceptsAFileMadeForTheModelAndParams) {
  const auto path = write("ok.bin", testing::dense_shape(), 5);
  layout::KvParams params;
  params.n_ctx = 512;
  auto summary = verify_state_file(path, model_, params);
  ASSERT_TRUE(summary) << summary.error().what();
  EXPECT_NE(summary->find("ok: "), std::string::npos);
}

// llama-server's packed tokens take 4 words more than the prompt's ids; what must fit the
// slot is the prompt (its restore checks the unpacked size against n_ctx), so a prompt of
// n_ctx - 2 ids in a packed file (n_ctx + 2 words) restores.
TEST_F(StateVerifyTest, CountsThePromptsIdsNotThePackedWordsAgainstTheContext) {
  const auto shape = testing::dense_shape();
  const uint32_t n_ids = 254;
  std::vector<int32_t> ids(n_ids), words{-1, 1, static_cast<int32_t>(n_ids)};
  for (uint32_t i = 0; i < n_ids; ++i) words.push_back(ids[i] = static_cast<int32_t>(i % 100 + 1));
  words.push_back(0);  // no media chunks
  auto planned =
      layout::plan_state_layout(shape, static_cast<uint32_t>(words.size()), n_ids, layout::kStateSeqVersion3);
  ASSERT_TRUE(planned) << planned.error().what();
  std::vector<std::byte> rows(1 << 20, std::byte{0x3c});
  const auto bytes = layout::encode_state_file(*planned, words, [&](const layout::StateSection& section) {
    return std::span<const std::byte>(rows).first(section.data_bytes());
  });
  const auto path = dir_ / "packed.bin";
  kvshare::testing::write_file_bytes(path, bytes);
  auto read = read_state_file(path, &shape);
  ASSERT_TRUE(read) << read.error().what();
  ASSERT_EQ(read->layout().token_form, layout::StateTokenForm::server_packed);
  ASSERT_EQ(read->tokens(), ids);

  layout::KvParams params;
  params.n_ctx = 256;
  auto summary = verify_state_file(path, model_, params);
  EXPECT_TRUE(summary) << summary.error().what();
}

TEST_F(StateVerifyTest, NamesTheMismatchWithOtherCacheTypes) {
  const auto path = write("ok.bin", testing::dense_shape(), 5);
  layout::KvParams params;
  params.n_ctx = 512;
  params.type_k = params.type_v = GgmlType::Q8_0;
  auto summary = verify_state_file(path, model_, params);
  ASSERT_FALSE(summary);
  EXPECT_NE(summary.error().message().find("kv layer 0 K type is 1 (f16), layout says 8 (q8_0)"), std::string::npos)
      << summary.error().message();
}

TEST_F(StateVerifyTest, NamesTheVTranspositionMismatchWithFlashAttentionOff) {
  const auto path = write("ok.bin", testing::dense_shape(), 5);
  layout::KvParams params;
  params.n_ctx = 512;
  params.flash_attn = false;
  auto summary = verify_state_file(path, model_, params);
  ASSERT_FALSE(summary);
  EXPECT_NE(summary.error().message().find("v_trans is 0, layout says 1"), std::string::npos)
      << summary.error().message();
}

// An LFM2 model (metadata only) like the vector's: 4 layers, conv on 0 and 2 with
// shortconv.l_cache `l_cache`, attention on 1 and 3 (1 KV head of 64).
std::filesystem::path write_lfm2_model(const std::filesystem::path& path, uint32_t l_cache) {
  layout::GgufWriter gguf;
  gguf.add_string("general.architecture", "lfm2");
  gguf.add_u32("lfm2.block_count", 4);
  gguf.add_u32("lfm2.context_length", 4096);
  gguf.add_u32("lfm2.embedding_length", 64);
  gguf.add_u32("lfm2.feed_forward_length", 256);
  gguf.add_u32("lfm2.attention.head_count", 1);
  gguf.add_u32_array("lfm2.attention.head_count_kv", {0, 1, 0, 1});
  gguf.add_u32("lfm2.shortconv.l_cache", l_cache);
  auto bytes = gguf.finish(layout::GgufPayload::kMetaOnly);
  EXPECT_TRUE(bytes) << bytes.error().what();
  kvshare::testing::write_file_bytes(path, *bytes);
  return path;
}

TEST_F(StateToolsTest, VerifyTakesTheRecurrentSectionsOfAnLfm2FileFromTheModel) {
  const auto vector = kvshare::testing::data_path("state-v3-lfm2-hybrid.bin");
  layout::KvParams params;
  params.n_ctx = 512;
  auto summary = verify_state_file(vector, write_lfm2_model(dir_ / "lfm2.gguf", 3), params);
  ASSERT_TRUE(summary) << summary.error().what();
  EXPECT_NE(summary->find("ok: "), std::string::npos) << *summary;

  // l_cache 4: n_embd_r 192 (768 bytes), not the file's 512.
  summary = verify_state_file(vector, write_lfm2_model(dir_ / "lfm2-l4.gguf", 4), params);
  ASSERT_FALSE(summary);
  EXPECT_NE(summary.error().message().find("recurrent layer 0 R row size is 512 bytes, layout says 768 (offset 2740)"),
            std::string::npos)
      << summary.error().message();
}

}  // namespace
}  // namespace kvshare::statefile
