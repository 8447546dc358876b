// Runs build/bin/kvshare-layout-dump as a user would, on shape-only GGUFs written here.
#include <gtest/gtest.h>

#include <ostream>
#include <string>

#include "layout/gguf_writer.h"
#include "support/test_support.h"

namespace kvshare {
namespace {

using testing::CommandResult;
using testing::run_command;
using testing::TempDir;
using testing::tool_path;

std::string tool() { return tool_path("kvshare-layout-dump").string(); }

// Qwen3-Coder-30B-A3B's shape, metadata only (no tensors, no data section).
std::filesystem::path write_qwen3_coder_shape(const TempDir& dir) {
  layout::GgufWriter writer;
  writer.add_string("general.architecture", "qwen3moe");
  writer.add_string("general.name", "Qwen3-Coder-30B-A3B shape");
  writer.add_u32("qwen3moe.block_count", 48);
  writer.add_u32("qwen3moe.context_length", 262144);
  writer.add_u32("qwen3moe.embedding_length", 2048);
  writer.add_u32("qwen3moe.feed_forward_length", 5472);
  writer.add_u32("qwen3moe.attention.head_count", 32);
  writer.add_u32("qwen3moe.attention.head_count_kv", 4);
  writer.add_u32("qwen3moe.attention.key_length", 128);
  writer.add_u32("qwen3moe.attention.value_length", 128);
  writer.add_u32("qwen3moe.expert_count", 128);
  writer.add_u32("qwen3moe.expert_used_count", 8);
  auto bytes = writer.finish(layout::GgufPayload::kMetaOnly);
  EXPECT_TRUE(bytes.has_value()) << bytes.error().what();
  const auto path = dir / "qwen3-coder-30b-a3b-shape.gguf";
  testing::write_file_bytes(path, *bytes);
  return path;
}

TEST(LayoutDumpTool, PrintsQwen3CoderTotalsAt8192TokensWithFlashAttention) {
  TempDir dir;
  const auto model = write_qwen3_coder_shape(dir);
  const CommandResult result = run_command(tool() + " " + model.string() + " -c 8192 -fa on");
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_NE(result.out.find("total: 805306368 bytes (768.00 MiB) in 1 chunks, 96 tensors"), std::string::npos)
      << result.out;
  EXPECT_NE(result.out.find("kv bytes per token: 98304"), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("cache_v_l47"), std::string::npos) << result.out;
}

TEST(LayoutDumpTool, WritesAHeaderThatHeaderModeAccepts) {
  TempDir dir;
  const auto model = write_qwen3_coder_shape(dir);
  const auto header = dir / "layout.json";
  const CommandResult dump = run_command(tool() + " " + model.string() + " -c 8192 -np 2 --json");
  ASSERT_EQ(dump.exit_code, 0) << dump.err;
  testing::write_file_bytes(
      header, std::vector<std::byte>(reinterpret_cast<const std::byte*>(dump.out.data()),
                                     reinterpret_cast<const std::byte*>(dump.out.data()) + dump.out.size()));
  const CommandResult check = run_command(tool() + " --header " + header.string());
  ASSERT_EQ(check.exit_code, 0) << check.err;
  EXPECT_NE(check.out.find("valid layout header, format version 1"), std::string::npos) << check.out;
  // -np 2 without -kvu: two streams of 4096 cells, the same bytes in total.
  EXPECT_NE(check.out.find("total: 805306368 bytes"), std::string::npos) << check.out;
  EXPECT_NE(check.out.find("n_stream 2"), std::string::npos) << check.out;
}

TEST(LayoutDumpTool, FailsWithExitCode1OnAMalformedHeader) {
  TempDir dir;
  const auto header = dir / "bad.json";
  const std::string text = "{\"format\": \"kvshare-layout\", \"format_version\": 7}";
  testing::write_file_bytes(header,
                            std::vector<std::byte>(reinterpret_cast<const std::byte*>(text.data()),
                                                   reinterpret_cast<const std::byte*>(text.data()) + text.size()));
  const CommandResult result = run_command(tool() + " --header " + header.string());
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_NE(result.err.find("format_version"), std::string::npos) << result.err;
}

TEST(LayoutDumpTool, FailsWithExitCode1OnAFileThatIsNotGguf) {
  TempDir dir;
  const auto path = dir / "not.gguf";
  testing::write_file_bytes(path, std::vector<std::byte>(64, std::byte{0x41}));
  const CommandResult result = run_command(tool() + " " + path.string());
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_NE(result.err.find("not.gguf"), std::string::npos) << result.err;
}

TEST(LayoutDumpTool, ExitsWith2OnBadUsage) {
  EXPECT_EQ(run_command(tool()).exit_code, 2);
  EXPECT_EQ(run_command(tool() + " model.gguf -fa sometimes").exit_code, 2);
  const CommandResult bad_type = run_command(tool() + " model.gguf -ctk q4_K");
  EXPECT_EQ(bad_type.exit_code, 2);
  EXPECT_NE(bad_type.err.find("-ctk"), std::string::npos) << bad_type.err;
  EXPECT_EQ(run_command(tool() + " model.gguf -ctv q8_0 -fa off").exit_code, 2);
}

TEST(LayoutDumpTool, PrintsHelpAndExits0) {
  const CommandResult result = run_command(tool() + " --help");
  EXPECT_EQ(result.exit_code, 0);
  EXPECT_NE(result.out.find("--header"), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("qwen3moe"), std::string::npos) << result.out;
}

// The memory-kind vectors of docs/layout.md are what the two tools print for a model
// kvshare-mkmodel writes: rerun them, so a change to either tool (or to the generator's
// tensor list, which the fingerprint hashes) that would change a vector shows here.
struct KindVector {
  const char* arch;
  const char* n_ctx;
  const char* file;
};

// Names the vector in test listings instead of the struct's bytes.
void PrintTo(const KindVector& vector, std::ostream* os) { *os << vector.file; }

class LayoutDumpToolKinds : public ::testing::TestWithParam<KindVector> {};

TEST_P(LayoutDumpToolKinds, PrintsTheVectorForTheModelMkmodelWrites) {
  TempDir dir;
  const auto model = dir / (std::string(GetParam().arch) + ".gguf");
  const CommandResult made =
      run_command(tool_path("kvshare-mkmodel").string() + " " + model.string() + " --arch " + GetParam().arch);
  ASSERT_EQ(made.exit_code, 0) << made.err;
  const CommandResult dump = run_command(tool() + " " + model.string() + " -c " + GetParam().n_ctx + " --json");
  ASSERT_EQ(dump.exit_code, 0) << dump.err;
  const auto vector = testing::read_file_bytes(testing::data_path(GetParam().file));
  EXPECT_EQ(dump.out, std::string(reinterpret_cast<const char*>(vector.data()), vector.size()));
}

INSTANTIATE_TEST_SUITE_P(Kinds, LayoutDumpToolKinds,
                         ::testing::Values(KindVector{"mamba2", "512", "layout-recurrent-mamba2.json"},
                                           KindVector{"gemma3", "1024", "layout-kv_iswa-gemma3.json"},
                                           KindVector{"qwen35", "512", "layout-hybrid-qwen35.json"},
                                           KindVector{"lfm2", "512", "layout-hybrid-lfm2.json"}),
                         [](const ::testing::TestParamInfo<KindVector>& info) { return std::string(info.param.arch); });

TEST(LayoutDumpTool, ShowsBothIswaCachesAndTheRecurrentStateOfMkmodelModels) {
  TempDir dir;
  const auto gemma3 = dir / "gemma3.gguf";
  const auto lfm2 = dir / "lfm2.gguf";
  ASSERT_EQ(run_command(tool_path("kvshare-mkmodel").string() + " " + gemma3.string() + " --arch gemma3").exit_code, 0);
  ASSERT_EQ(run_command(tool_path("kvshare-mkmodel").string() + " " + lfm2.string() + " --arch lfm2").exit_code, 0);
  const CommandResult iswa = run_command(tool() + " " + gemma3.string() + " -c 1024");
  ASSERT_EQ(iswa.exit_code, 0) << iswa.err;
  EXPECT_NE(iswa.out.find("cache 0 (base): kv_size 1024, n_stream 1, K f16, V f16, v_trans no, n_swa 0, layers [1]"),
            std::string::npos)
      << iswa.out;
  EXPECT_NE(iswa.out.find("cache 1 (swa): kv_size 768, n_stream 1, K f16, V f16, v_trans no, n_swa 32, layers [0]"),
            std::string::npos)
      << iswa.out;
  const CommandResult hybrid = run_command(tool() + " " + lfm2.string() + " -c 512");
  ASSERT_EQ(hybrid.exit_code, 0) << hybrid.err;
  EXPECT_NE(hybrid.out.find("cache 1 (recurrent): rs_size 1 (cells, one per sequence), f32 r/s state, layers [0], "
                            "n_embd_r 384 (1536 bytes per cell), n_embd_s 0 (empty tensors: 0 bytes in the region)"),
            std::string::npos)
      << hybrid.out;
  EXPECT_NE(hybrid.out.find("recurrent bytes per sequence: 1536"), std::string::npos) << hybrid.out;
}

}  // namespace
}  // namespace kvshare
