#include "kvshare/route/prompt_n_scanner.h"

#include <gtest/gtest.h>

namespace kvshare::route {
namespace {

TEST(PromptNScanner, FindsPromptNInTheFinalSseChunkSplitAnywhere) {
  const std::string stream =
      "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n"
      "data: {\"choices\":[],\"timings\":{\"cache_n\":41,\"prompt_n\":1}}\n\n"
      "data: [DONE]\n\n";
  for (size_t split = 0; split <= stream.size(); ++split) {
    PromptNScanner scanner(true);
    scanner.feed(std::string_view(stream).substr(0, split));
    scanner.feed(std::string_view(stream).substr(split));
    EXPECT_EQ(scanner.finish(), 1) << "split at " << split;
  }
}

TEST(PromptNScanner, ReadsCrlfFramedEvents) {
  PromptNScanner scanner(true);
  scanner.feed("data: {\"timings\":{\"prompt_n\":7}}\r\n\r\n");
  EXPECT_EQ(scanner.finish(), 7);
}

TEST(PromptNScanner, FindsPromptNInAPlainJsonReply) {
  PromptNScanner scanner(false);
  scanner.feed("{\"choices\":[],\"timi");
  scanner.feed("ngs\":{\"prompt_n\":12}}");
  EXPECT_EQ(scanner.finish(), 12);
}

TEST(PromptNScanner, SaysNothingWhenTheReplyHasNoTimingsOrIsNotJson) {
  PromptNScanner sse(true);
  sse.feed("data: {\"choices\":[]}\n\ndata: {\"prompt_n\": broken\n\n");
  EXPECT_EQ(sse.finish(), std::nullopt);
  PromptNScanner json(false);
  json.feed("<html>502</html>");
  EXPECT_EQ(json.finish(), std::nullopt);
}

}  // namespace
}  // namespace kvshare::route
