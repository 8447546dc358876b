#include "route/sse_events.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cerrno>

namespace kvshare::route {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(SseEvents, GivesEachDataPayloadInOrderAndSkipsPings) {
  auto events = parse_sse_events("data: {\"a\":1}\n\n: ping\n\ndata: [DONE]\n\n");
  ASSERT_TRUE(events) << events.error().what();
  EXPECT_THAT(*events, ElementsAre("{\"a\":1}", "[DONE]"));
}

TEST(SseEvents, NamesTheOffsetOfAnEventWithoutItsBlankLine) {
  auto events = parse_sse_events("data: 1\n\ndata: 2\n");
  ASSERT_FALSE(events);
  EXPECT_EQ(events.error().errno_value(), EINVAL);
  EXPECT_THAT(events.error().message(), HasSubstr("event at byte 9 is not terminated by a blank line"));
}

TEST(SseEvents, RefusesAnEventThatIsNotADataLine) {
  auto events = parse_sse_events("event: x\n\n");
  ASSERT_FALSE(events);
  EXPECT_EQ(events.error().errno_value(), EINVAL);
  EXPECT_THAT(events.error().message(), HasSubstr("event at byte 0 does not start with \"data: \""));
}

TEST(SseEvents, RefusesAnEventOfSeveralLines) {
  auto events = parse_sse_events("data: 1\ndata: 2\n\n");
  ASSERT_FALSE(events);
  EXPECT_EQ(events.error().errno_value(), EINVAL);
  EXPECT_THAT(events.error().message(), HasSubstr("event at byte 0 spans several lines"));
}

}  // namespace
}  // namespace kvshare::route
