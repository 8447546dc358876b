#include "route/reply_timings_scanner.h"

#include <gtest/gtest.h>

namespace kvshare::route {
namespace {

TEST(ReplyTimingsScanner, FindsPromptNInTheFinalSseChunkSplitAnywhere) {
  const std::string stream =
      "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n"
      "data: {\"choices\":[],\"timings\":{\"cache_n\":41,\"prompt_n\":1}}\n\n"
      "data: [DONE]\n\n";
  for (size_t split = 0; split <= stream.size(); ++split) {
    ReplyTimingsScanner scanner(true);
    scanner.feed(std::string_view(stream).substr(0, split));
    scanner.feed(std::string_view(stream).substr(split));
    EXPECT_EQ(scanner.finish().prompt_n, 1) << "split at " << split;
  }
}

TEST(ReplyTimingsScanner, ReadsCrlfFramedEvents) {
  ReplyTimingsScanner scanner(true);
  scanner.feed("data: {\"timings\":{\"prompt_n\":7}}\r\n\r\n");
  EXPECT_EQ(scanner.finish().prompt_n, 7);
}

TEST(ReplyTimingsScanner, FindsPromptNInAPlainJsonReply) {
  ReplyTimingsScanner scanner(false);
  scanner.feed("{\"choices\":[],\"timi");
  scanner.feed("ngs\":{\"prompt_n\":12}}");
  EXPECT_EQ(scanner.finish().prompt_n, 12);
}

TEST(ReplyTimingsScanner, SaysNothingWhenTheReplyHasNoTimingsOrIsNotJson) {
  ReplyTimingsScanner sse(true);
  sse.feed("data: {\"choices\":[]}\n\ndata: {\"prompt_n\": broken\n\n");
  EXPECT_EQ(sse.finish().prompt_n, std::nullopt);
  ReplyTimingsScanner json(false);
  json.feed("<html>502</html>");
  EXPECT_EQ(json.finish().prompt_n, std::nullopt);
}

TEST(ReplyTimingsScanner, ReadsThePromptSpeedAndTheGeneratedCount) {
  ReplyTimingsScanner scanner(true);
  scanner.feed("data: {\"timings\":{\"prompt_n\":40,\"prompt_ms\":12.5,\"predicted_n\":9}}\n\n");
  const ReplyTimings timings = scanner.finish();
  EXPECT_EQ(timings.prompt_n, 40);
  EXPECT_EQ(timings.prompt_ms, 12.5);
  EXPECT_EQ(timings.predicted_n, 9);
}

TEST(ReplyTimingsScanner, ReadsTheStreamsPace) {
  ReplyTimingsScanner scanner(true);
  scanner.feed("data: {\"timings\":{\"prompt_n\":1,\"predicted_n\":64,\"predicted_ms\":556.8}}\n\n");
  EXPECT_EQ(scanner.finish().predicted_ms, 556.8);
}

TEST(ReplyTimingsScanner, LeavesOutAFieldOfTheWrongType) {
  ReplyTimingsScanner scanner(false);
  scanner.feed("{\"timings\":{\"prompt_n\":3,\"prompt_ms\":\"fast\",\"predicted_n\":1.5}}");
  const ReplyTimings timings = scanner.finish();
  EXPECT_EQ(timings.prompt_n, 3);
  EXPECT_EQ(timings.prompt_ms, std::nullopt);
  EXPECT_EQ(timings.predicted_n, std::nullopt);
}

}  // namespace
}  // namespace kvshare::route
