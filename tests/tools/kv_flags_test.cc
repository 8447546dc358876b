// Every tool that takes llama-server's KV flags reads them through tools/cli/kv_flags.h:
// each refuses a -fa value llama-server refuses as bad usage, naming the flag and the value.
#include <gtest/gtest.h>

#include <ostream>
#include <string>

#include "support/test_support.h"

namespace kvshare {
namespace {

using testing::CommandResult;
using testing::run_command;
using testing::TempDir;
using testing::tool_path;

struct ToolCase {
  const char* tool;
  const char* arguments;  // everything a run needs but the KV flag; MODEL and DIR are replaced
};

std::ostream& operator<<(std::ostream& out, const ToolCase& c) { return out << c.tool; }

std::string command_line(const ToolCase& c, const TempDir& dir, const std::string& kv_flag) {
  std::string arguments = c.arguments;
  for (const auto& [name, value] : {std::pair<std::string, std::string>{"MODEL", (dir / "absent.gguf").string()},
                                    std::pair<std::string, std::string>{"DIR", dir.path().string()}}) {
    for (size_t at = arguments.find(name); at != std::string::npos; at = arguments.find(name))
      arguments.replace(at, name.size(), value);
  }
  return tool_path(c.tool).string() + " " + arguments + " " + kv_flag;
}

class KvFlagsTool : public ::testing::TestWithParam<ToolCase> {};

// "-fa of" used to mean on in kvshare-prefill, kvshare-layout-dump and kvshare-state
// (anything but "off" was on), and kvshare-serve refused llama-server's own "auto".
TEST_P(KvFlagsTool, RefusesAFlashAttnTypoAsBadUsageNamingTheFlagAndTheValue) {
  TempDir dir;
  const CommandResult result = run_command(command_line(GetParam(), dir, "-fa of"));
  EXPECT_EQ(result.exit_code, 2) << result.err;
  EXPECT_NE(result.err.find("unknown value for --flash-attn: 'of'"), std::string::npos) << result.err;
  EXPECT_NE(result.err.find("on, off or auto"), std::string::npos) << result.err;
}

TEST_P(KvFlagsTool, RefusesACacheTypeLlamaServerRefusesNamingTheFlag) {
  TempDir dir;
  const CommandResult result = run_command(command_line(GetParam(), dir, "-ctv q4_K"));
  EXPECT_EQ(result.exit_code, 2) << result.err;
  EXPECT_NE(result.err.find("-ctv: cache type \"q4_K\""), std::string::npos) << result.err;
}

TEST_P(KvFlagsTool, ShowsLlamaServersFlashAttnDefaultInItsHelp) {
  TempDir dir;
  const CommandResult result = run_command(command_line(GetParam(), dir, "--help"));
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_NE(result.out.find("on, off or auto"), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("--flash-attn,--fa TEXT=auto"), std::string::npos) << result.out;
}

INSTANTIATE_TEST_SUITE_P(EveryToolKind, KvFlagsTool,
                         ::testing::Values(ToolCase{"kvshare-decoder", "-m MODEL --port 0"},
                                           ToolCase{"kvshare-layout-dump", "MODEL"},
                                           ToolCase{"kvshare-prefill", "--model MODEL --tokens DIR/ids --out DIR/out"},
                                           ToolCase{"kvshare-serve", "-m MODEL --port 0"},
                                           ToolCase{"kvshare-state", "verify DIR/slot.bin MODEL"}),
                         [](const ::testing::TestParamInfo<ToolCase>& info) {
                           std::string name = info.param.tool + std::string("kvshare-").size();
                           for (char& c : name)
                             if (c == '-') c = '_';
                           return name;
                         });

}  // namespace
}  // namespace kvshare
