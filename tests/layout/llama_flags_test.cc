// The one table of llama-server's flag spellings every tool reads (issue #25: five tools
// had five tables with different aliases).
#include "layout/llama_flags.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kvshare::layout {
namespace {

TEST(NormalizeLlamaFlags, RewritesMultiLetterShortFlagsBeforeTheSeparatorOnly) {
  const auto args = normalize_llama_flags({"-fa", "off", "-ctk=q8_0", "-np", "1", "--", "-fa", "on"});
  const std::vector<std::string> expected = {"--flash-attn", "off", "--cache-type-k=q8_0", "--parallel", "1", "--",
                                             "-fa",          "on"};
  EXPECT_EQ(args, expected);
}

TEST(NormalizeLlamaFlags, KnowsEverySpellingOfLlamaServersKvFlags) {
  const auto args = normalize_llama_flags({"-np", "-kvu", "-ctk", "-ctv", "-fa", "-ub", "-ngl", "-dev=none"});
  const std::vector<std::string> expected = {"--parallel",   "--kv-unified",  "--cache-type-k", "--cache-type-v",
                                             "--flash-attn", "--ubatch-size", "--n-gpu-layers", "--device=none"};
  EXPECT_EQ(args, expected);
}

TEST(NormalizeLlamaFlags, LeavesEverythingElseAsItIs) {
  const std::vector<std::string> args = {"-c", "512", "-m", "m.gguf", "--parallel", "2", "-npx", "-f", "-fa2", "x"};
  EXPECT_EQ(normalize_llama_flags(args), args);
}

}  // namespace
}  // namespace kvshare::layout
