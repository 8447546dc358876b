// What serve reads of a client's request before the handoff. Bug pinned: a chat content
// part whose "type" was not a string made nlohmann's value() throw out of the handoff, so
// such a request was answered 500 by serve instead of being forwarded to the decoder.
#include <gmock/gmock.h>

#include <cerrno>

#include "route/handoff.h"

namespace kvshare::route {
namespace {

using ::testing::HasSubstr;
using Json = nlohmann::json;

void expect_refused(const Result<std::optional<std::string>>& prompt, const std::string& words) {
  ASSERT_FALSE(prompt) << "took it as a text prompt";
  EXPECT_EQ(prompt.error().errno_value(), EINVAL);
  EXPECT_THAT(prompt.error().message(), HasSubstr(words));
}

TEST(RequestPrompt, RefusesAContentPartWhoseTypeIsNotAStringWithoutThrowing) {
  const Json request = Json::parse(R"({"messages": [{"role": "user", "content": [{"type": 1, "text": "hi"}]}]})");
  expect_refused(request_prompt(Endpoint::chat_completions, request), "messages[0].content is not text");
}

TEST(RequestPrompt, LeavesTextMessagesToTheDecodersTemplate) {
  const Json request = Json::parse(
      R"({"messages": [{"role": "system", "content": null},
                       {"role": "user", "content": [{"type": "text", "text": "hi"}]}]})");
  auto prompt = request_prompt(Endpoint::chat_completions, request);
  ASSERT_TRUE(prompt) << prompt.error().what();
  EXPECT_FALSE(prompt->has_value());
}

TEST(RequestPrompt, RefusesAnImagePartNamingTheMessage) {
  const Json request = Json::parse(
      R"({"messages": [{"role": "user", "content": "a"},
                       {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})");
  expect_refused(request_prompt(Endpoint::chat_completions, request), "messages[1].content is not text");
}

TEST(RequestPrompt, TakesTheOneStringPromptOfACompletion) {
  auto prompt = request_prompt(Endpoint::completions, Json::parse(R"({"prompt": ["once upon"]})"));
  ASSERT_TRUE(prompt) << prompt.error().what();
  EXPECT_EQ(prompt->value_or(""), "once upon");
}

TEST(RequestPrompt, RefusesTokenIdsAndABodyThatIsNoObject) {
  expect_refused(request_prompt(Endpoint::completions, Json::parse(R"({"prompt": [1, 2]})")), "not one text string");
  expect_refused(request_prompt(Endpoint::chat_completions, Json::parse("[1]")), "not a JSON object");
}

}  // namespace
}  // namespace kvshare::route
