#include "layout/layout_dump.h"

#include <gtest/gtest.h>

#include "layout/gguf_writer.h"
#include "layout/shape_fixtures.h"

namespace kvshare::layout {
namespace {

// A shape-only GGUF image (metadata, no tensors) of the given metadata, parsed back.
struct ParsedModel {
  std::vector<std::byte> bytes;
  GgufFile file;
};

ParsedModel shape_only(const GgufMetadata& metadata) {
  GgufWriter writer;
  for (const auto& [key, value] : metadata.entries()) writer.set(key, value);
  ParsedModel out;
  auto bytes = writer.finish(GgufPayload::kMetaOnly);
  EXPECT_TRUE(bytes.has_value()) << bytes.error().what();
  out.bytes = std::move(*bytes);
  auto file = parse_gguf(out.bytes, "model.gguf");
  EXPECT_TRUE(file.has_value()) << file.error().what();
  out.file = std::move(*file);
  return out;
}

KvParams ctx(uint32_t n_ctx) {
  KvParams params;
  params.n_ctx = n_ctx;
  return params;
}

TEST(LayoutDump, ReportsTotalsAndBytesPerTokenForQwen3Coder) {
  const ParsedModel model = shape_only(testing::qwen3_coder_30b().metadata());
  auto report = render_layout_dump(model.file, ctx(8192), false);
  ASSERT_TRUE(report.has_value()) << report.error().what();
  // 48 layers * (K + V) * 8192 cells * 512 elements * 2 bytes.
  EXPECT_NE(report->find("total: 805306368 bytes (768.00 MiB) in 1 chunks, 96 tensors"), std::string::npos) << *report;
  EXPECT_NE(report->find("kv bytes per token: 98304"), std::string::npos) << *report;
}

TEST(LayoutDump, ListsEveryTensorWithItsPlacement) {
  const ParsedModel model = shape_only(testing::worked_example_model().metadata());
  auto report = render_layout_dump(model.file, ctx(512), false);
  ASSERT_TRUE(report.has_value()) << report.error().what();
  EXPECT_NE(report->find("cache_v_l1       f16    [128, 512, 1, 1]               0       393216       131072"),
            std::string::npos)
      << *report;
  EXPECT_NE(report->find("0xc152419dd99b2d2f"), std::string::npos) << *report;
}

TEST(LayoutDump, PrintsTheHeaderAsJson) {
  const ParsedModel model = shape_only(testing::worked_example_model().metadata());
  auto json = render_layout_dump(model.file, ctx(512), true);
  ASSERT_TRUE(json.has_value()) << json.error().what();
  auto header = parse_share_header(*json, "dump");
  ASSERT_TRUE(header.has_value()) << header.error().what();
  EXPECT_EQ(header->layout.chunks[0].layout_hash, 0xc152419dd99b2d2full);
  EXPECT_EQ(header->model.arch, "llama");
}

TEST(LayoutDump, NamesTheModelFileWhenTheArchIsUnsupported) {
  testing::MetadataBuilder builder = testing::transformer("bert", 2, 768, 12, 12);
  const ParsedModel model = shape_only(builder.metadata());
  auto report = render_layout_dump(model.file, ctx(512), false);
  ASSERT_FALSE(report.has_value());
  EXPECT_NE(report.error().message().find("model.gguf"), std::string::npos) << report.error().message();
  EXPECT_NE(report.error().message().find("\"bert\""), std::string::npos) << report.error().message();
}

TEST(LayoutDump, ChecksAHeaderDocument) {
  const ParsedModel model = shape_only(testing::worked_example_model().metadata());
  auto json = render_layout_dump(model.file, ctx(512), true);
  ASSERT_TRUE(json.has_value());
  auto report = render_header_check(*json, "layout.json");
  ASSERT_TRUE(report.has_value()) << report.error().what();
  EXPECT_EQ(report->rfind("layout.json: valid layout header, format version 1\n", 0), 0u) << *report;
  EXPECT_FALSE(render_header_check("{}", "layout.json").has_value());
}

// The report once named only how many layers a cache had and said nothing of the
// recurrent widths: which layer sat in which iSWA cache, and what a recurrent row held,
// could only be read from the JSON (issue 26).
TEST(LayoutDump, ShowsBothIswaCachesWithTheLayersEachOwns) {
  const ParsedModel model = shape_only(testing::mkmodel_gemma3().metadata());
  auto report = render_layout_dump(model.file, ctx(1024), false);
  ASSERT_TRUE(report.has_value()) << report.error().what();
  EXPECT_NE(report->find("cache 0 (base): kv_size 1024, n_stream 1, K f16, V f16, v_trans no, n_swa 0, layers [1]\n"),
            std::string::npos)
      << *report;
  EXPECT_NE(report->find("cache 1 (swa): kv_size 768, n_stream 1, K f16, V f16, v_trans no, n_swa 32, layers [0]\n"),
            std::string::npos)
      << *report;
  EXPECT_NE(report->find("cache_k_l0       f16    [128, 768, 1, 1]               1            0       196608  1 swa\n"),
            std::string::npos)
      << *report;
}

TEST(LayoutDump, SaysWhenAnIswaCacheOwnsNoLayer) {
  // gemma3's default pattern (period 6) makes both layers of a 2-layer model SWA.
  auto gemma3 = testing::mkmodel_gemma3().remove_by_rebuilding("attention.sliding_window_pattern");
  const ParsedModel model = shape_only(gemma3.metadata());
  auto report = render_layout_dump(model.file, ctx(1024), false);
  ASSERT_TRUE(report.has_value()) << report.error().what();
  EXPECT_NE(report->find("cache 0 (base): kv_size 1024, n_stream 1, K f16, V f16, v_trans no, n_swa 0, no layers (no "
                         "tensors, no chunk)\n"),
            std::string::npos)
      << *report;
  EXPECT_NE(report->find("layers [0, 1]\n"), std::string::npos) << *report;
}

TEST(LayoutDump, ShowsTheRecurrentLayersWidthsAndTensors) {
  const ParsedModel model = shape_only(testing::mkmodel_qwen35().metadata());
  auto report = render_layout_dump(model.file, ctx(512), false);
  ASSERT_TRUE(report.has_value()) << report.error().what();
  EXPECT_NE(report->find("cache 1 (recurrent): rs_size 1 (cells, one per sequence), f32 r/s state, layers [0, 1, 2], "
                         "n_embd_r 384 (1536 bytes per cell), n_embd_s 1024 (4096 bytes per cell)\n"),
            std::string::npos)
      << *report;
  EXPECT_NE(
      report->find("cache_s_l2       f32    [1024, 1, 1, 1]                1        20480         4096  1 recurrent\n"),
      std::string::npos)
      << *report;
  EXPECT_NE(report->find("recurrent bytes per sequence: 16896\n"), std::string::npos) << *report;
}

TEST(LayoutDump, SaysAZeroWidthStateTakesNoBytes) {
  const ParsedModel model = shape_only(testing::mkmodel_lfm2().metadata());
  auto report = render_layout_dump(model.file, ctx(512), false);
  ASSERT_TRUE(report.has_value()) << report.error().what();
  EXPECT_NE(report->find("n_embd_s 0 (empty tensors: 0 bytes in the region)\n"), std::string::npos) << *report;
  EXPECT_NE(
      report->find("cache_s_l0       f32    [0, 1, 1, 1]                   1         4096            0  1 recurrent\n"),
      std::string::npos)
      << *report;
}

TEST(LayoutDump, PrintsNoRecurrentLineForAKvOnlyModel) {
  const ParsedModel model = shape_only(testing::worked_example_model().metadata());
  auto report = render_layout_dump(model.file, ctx(512), false);
  ASSERT_TRUE(report.has_value()) << report.error().what();
  EXPECT_EQ(report->find("recurrent"), std::string::npos) << *report;
}

}  // namespace
}  // namespace kvshare::layout
