// The offer a decoder hands out for the remote route (docs/remote.md, "The offer"): its
// JSON round trip and the refusal, by field name, of an offer without a usable secret.
#include "kvshare/remote/remote_offer.h"

#include <gtest/gtest.h>

#include <string>

#include "layout/remote_grant.h"
#include "remote_fixture.h"

namespace kvshare::remote {
namespace {

RemoteOffer example_offer() {
  RemoteOffer offer;
  offer.share_id = 0x1122334455667788ull;
  for (size_t i = 0; i < offer.secret.size(); ++i) offer.secret[i] = static_cast<std::byte>(0x11 * i);
  offer.worker_address = std::vector<std::byte>(60, std::byte{0xab});
  offer.header = layout::testing::remote_example_header();
  offer.n_cells = 10;
  offer.bytes = layout::granted_bytes(offer.header.layout, offer.header.memory, offer.n_cells);
  offer.layout_hash = layout::whole_layout_hash(offer.header.layout);
  offer.timeout_ms = 120000;
  return offer;
}

nlohmann::json example_json() { return nlohmann::json::parse(to_json(example_offer()).dump()); }

std::string refusal(const nlohmann::json& json) {
  auto parsed = parse_offer(json, "the test");
  EXPECT_FALSE(parsed);
  if (parsed) return {};
  EXPECT_EQ(parsed.error().errno_value(), EINVAL);
  return parsed.error().message();
}

TEST(RemoteOffer, CarriesTheSecretAsThirtyTwoLowercaseHexDigitsInVersion2) {
  const nlohmann::json json = example_json();
  EXPECT_EQ(json["version"], 2);
  EXPECT_EQ(json["secret"], "00112233445566778899aabbccddeeff");
  auto back = parse_offer(json, "the test");
  ASSERT_TRUE(back) << back.error().what();
  EXPECT_EQ(back->secret, example_offer().secret);
  EXPECT_EQ(back->share_id, example_offer().share_id);
}

TEST(RemoteOffer, RefusesAVersion1OfferNamingTheSecret) {
  nlohmann::json json = example_json();
  json["version"] = 1u;
  json.erase("secret");
  const std::string why = refusal(json);
  EXPECT_NE(why.find("version 1, this side speaks version 2"), std::string::npos) << why;
  EXPECT_NE(why.find("\"secret\""), std::string::npos) << why;
}

TEST(RemoteOffer, RefusesAMissingSecretByName) {
  nlohmann::json json = example_json();
  json.erase("secret");
  EXPECT_NE(refusal(json).find("field \"secret\" is missing or not a string"), std::string::npos);
}

TEST(RemoteOffer, RefusesASecretThatIsNotAString) {
  nlohmann::json json = example_json();
  json["secret"] = 12345;
  EXPECT_NE(refusal(json).find("field \"secret\" is missing or not a string"), std::string::npos);
}

TEST(RemoteOffer, RefusesASecretOfAnotherLength) {
  nlohmann::json json = example_json();
  json["secret"] = "00112233445566778899aabbccddeef";
  EXPECT_NE(refusal(json).find("field \"secret\" is 31 characters, expected 32"), std::string::npos);
}

TEST(RemoteOffer, RefusesAnUppercaseSecretNamingThePositionNotTheText) {
  nlohmann::json json = example_json();
  json["secret"] = "00112233445566778899AABBCCDDEEFF";
  const std::string why = refusal(json);
  EXPECT_NE(why.find("field \"secret\" has a character other than 0-9a-f at 20"), std::string::npos) << why;
  EXPECT_EQ(why.find("AABB"), std::string::npos) << "the refusal shows the secret: " << why;
}

TEST(RemoteOffer, RefusesAnAllZeroSecret) {
  nlohmann::json json = example_json();
  json["secret"] = std::string(32, '0');
  EXPECT_NE(refusal(json).find("field \"secret\" is all zeros"), std::string::npos);
}

}  // namespace
}  // namespace kvshare::remote
