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

}  // namespace
}  // namespace kvshare::layout
