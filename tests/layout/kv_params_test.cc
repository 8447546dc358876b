// layout::parse_flash_attn and apply_kv_flags: llama-server's -fa, -ctk and -ctv values,
// read the same way by every tool.
#include "layout/kv_params.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <string>

namespace kvshare::layout {
namespace {

TEST(ParseFlashAttn, TakesEveryValueLlamaServerTakesForOn) {
  for (const char* value : {"on", "enabled", "true", "1"}) {
    auto parsed = parse_flash_attn(value);
    ASSERT_TRUE(parsed) << value << ": " << parsed.error().what();
    EXPECT_TRUE(*parsed) << value;
  }
}

TEST(ParseFlashAttn, TakesEveryValueLlamaServerTakesForOff) {
  for (const char* value : {"off", "disabled", "false", "0"}) {
    auto parsed = parse_flash_attn(value);
    ASSERT_TRUE(parsed) << value << ": " << parsed.error().what();
    EXPECT_FALSE(*parsed) << value;
  }
}

TEST(ParseFlashAttn, ReadsAutoAsOnAsACpuLlamaServerResolvesIt) {
  for (const char* value : {"auto", "-1"}) {
    auto parsed = parse_flash_attn(value);
    ASSERT_TRUE(parsed) << value << ": " << parsed.error().what();
    EXPECT_TRUE(*parsed) << value;
  }
  EXPECT_EQ(kDefaultFlashAttn, "auto");
}

// A typo like "-fa of" used to read as on in kvshare-prefill (anything but "off" was on).
TEST(ParseFlashAttn, RefusesATypoNamingTheFlagTheValueAndTheAcceptedValues) {
  for (const char* value : {"of", "", "ON", "yes", "2"}) {
    auto parsed = parse_flash_attn(value);
    ASSERT_FALSE(parsed) << value;
    EXPECT_EQ(parsed.error().errno_value(), EINVAL);
    const std::string& message = parsed.error().message();
    EXPECT_NE(message.find("unknown value for --flash-attn: '" + std::string(value) + "'"), std::string::npos)
        << message;
    EXPECT_NE(message.find("-fa " + std::string(value)), std::string::npos) << message;
    EXPECT_NE(message.find("on, off or auto"), std::string::npos) << message;
  }
}

TEST(ApplyKvFlags, SetsFlashAttentionAndTheCacheTypes) {
  KvParams base;
  base.n_ctx = 1024;
  auto params = apply_kv_flags(base, "off", "q8_0", "bf16");
  ASSERT_TRUE(params) << params.error().what();
  EXPECT_FALSE(params->flash_attn);
  EXPECT_EQ(params->type_k, GgmlType::Q8_0);
  EXPECT_EQ(params->type_v, GgmlType::BF16);
  EXPECT_EQ(params->n_ctx, 1024u);
}

TEST(ApplyKvFlags, NamesTheCacheTypeFlagWhoseValueIsRefused) {
  auto bad_k = apply_kv_flags({}, "on", "q9_0", "f16");
  ASSERT_FALSE(bad_k);
  EXPECT_EQ(bad_k.error().message().rfind("-ctk: ", 0), 0u) << bad_k.error().message();
  EXPECT_NE(bad_k.error().message().find("\"q9_0\""), std::string::npos) << bad_k.error().message();
  auto bad_v = apply_kv_flags({}, "on", "f16", "f8");
  ASSERT_FALSE(bad_v);
  EXPECT_EQ(bad_v.error().message().rfind("-ctv: ", 0), 0u) << bad_v.error().message();
}

TEST(ApplyKvFlags, RefusesABadFlashAttnValueBeforeTheCacheTypes) {
  auto bad = apply_kv_flags({}, "sometimes", "f16", "f16");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message().find("--flash-attn: 'sometimes'"), std::string::npos) << bad.error().message();
}

}  // namespace
}  // namespace kvshare::layout
