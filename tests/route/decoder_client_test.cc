#include "route/decoder_client.h"

#include <gtest/gtest.h>

namespace kvshare::route {
namespace {

using Json = nlohmann::json;

// #43: llama-server capped -c 8192 to the model's 4096 and said so only in its log; serve
// handed a 7,650-token prompt to the provider and the restore failed. /props says 4096.
TEST(SlotContext, ReadsTheCappedSlotContextFromProps) {
  const Json props = Json::parse(R"({"default_generation_settings": {"params": {}, "n_ctx": 4096},
                                     "total_slots": 1})");
  auto n_ctx = slot_context_from_props(props);
  ASSERT_TRUE(n_ctx) << n_ctx.error().what();
  EXPECT_EQ(*n_ctx, 4096u);
}

TEST(SlotContext, NamesTheFieldPropsLacks) {
  for (const char* body : {R"({"total_slots": 4})", R"({"default_generation_settings": {"n_ctx": 0}})",
                           R"({"default_generation_settings": {"n_ctx": "4096"}})", "[]"}) {
    auto n_ctx = slot_context_from_props(Json::parse(body));
    ASSERT_FALSE(n_ctx) << body;
    EXPECT_EQ(n_ctx.error().errno_value(), EPROTO);
    EXPECT_NE(n_ctx.error().message().find("GET /props"), std::string::npos) << n_ctx.error().message();
  }
  auto zero = slot_context_from_props(Json::parse(R"({"default_generation_settings": {"n_ctx": 0}})"));
  EXPECT_NE(zero.error().message().find("field \"n_ctx\" is 0, expected a positive count of cells"), std::string::npos)
      << zero.error().message();
}

TEST(SlotContext, TakesTheSmallestSlotFromSlots) {
  const Json slots = Json::parse(R"([{"id": 0, "n_ctx": 1024}, {"id": 1, "n_ctx": 512}, {"id": 2, "n_ctx": 1024}])");
  auto n_ctx = slot_context_from_slots(slots);
  ASSERT_TRUE(n_ctx) << n_ctx.error().what();
  EXPECT_EQ(*n_ctx, 512u);
}

TEST(SlotContext, NamesTheSlotWithoutAContext) {
  auto n_ctx = slot_context_from_slots(Json::parse(R"([{"id": 0, "n_ctx": 1024}, {"id": 1}])"));
  ASSERT_FALSE(n_ctx);
  EXPECT_EQ(n_ctx.error().errno_value(), EPROTO);
  EXPECT_NE(n_ctx.error().message().find("GET /slots [1]: no field \"n_ctx\""), std::string::npos)
      << n_ctx.error().message();
  EXPECT_FALSE(slot_context_from_slots(Json::array()));
  EXPECT_FALSE(slot_context_from_slots(Json::object()));
}

}  // namespace
}  // namespace kvshare::route
