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
  offer.bytes = layout::granted_bytes({&offer.header.layout, &offer.header.memory, 0, 0, offer.n_cells});
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

TEST(RemoteOffer, CarriesTheSecretAsThirtyTwoLowercaseHexDigitsInVersion3) {
  const nlohmann::json json = example_json();
  EXPECT_EQ(json["version"], 3);
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
  EXPECT_NE(why.find("version 1, this side speaks version 3"), std::string::npos) << why;
  EXPECT_NE(why.find("\"secret\""), std::string::npos) << why;
}

TEST(RemoteOffer, RefusesAVersion2OfferNamingWhatVersion3Adds) {
  nlohmann::json json = example_json();
  json["version"] = 2u;
  for (const char* key : {"stream", "first_cell", "n_cached"}) json.erase(key);
  const std::string why = refusal(json);
  EXPECT_NE(why.find("version 2, this side speaks version 3 (version 2 grants cells 0..n-1 of one stream"),
            std::string::npos)
      << why;
}

// -np 4 without --kv-unified: slot 2's prompt of 30 positions from cell 16 of stream 2,
// the decoder holding the first 12.
RemoteOffer stream_offer() {
  RemoteOffer offer = example_offer();
  offer.header = layout::testing::remote_example_header(2048, true, 4);
  offer.stream = 2;
  offer.first_cell = 16;
  offer.n_cached = 12;
  offer.n_cells = 30;
  offer.bytes = layout::granted_bytes({&offer.header.layout, &offer.header.memory, 2, 28, 46});
  offer.layout_hash = layout::whole_layout_hash(offer.header.layout);
  return offer;
}

TEST(RemoteOffer, CarriesTheStreamAndTheGrantedCellsAndChecksThemAgainstTheHeader) {
  const nlohmann::json json = nlohmann::json::parse(to_json(stream_offer()).dump());
  EXPECT_EQ(json["stream"], 2);
  EXPECT_EQ(json["first_cell"], 16);
  EXPECT_EQ(json["n_cached"], 12);
  EXPECT_EQ(json["n_cells"], 30);
  auto back = parse_offer(json, "the test");
  ASSERT_TRUE(back) << back.error().what();
  EXPECT_EQ(back->stream, 2u);
  EXPECT_EQ(back->first_cell, 16u);
  EXPECT_EQ(back->n_cached, 12u);
  EXPECT_EQ(back->n_cells, 30u);
  auto grant = offer_grant(*back);
  ASSERT_TRUE(grant);
  EXPECT_EQ(grant->cell_begin, 28u);
  EXPECT_EQ(grant->cell_end, 46u);
  EXPECT_EQ(back->bytes, 2u * 2 * 18 * 256);
}

TEST(RemoteOffer, RefusesAGrantTheHeaderCannotHold) {
  struct Case {
    const char* key;
    uint64_t value;
    const char* says;
  };
  for (const Case& c : {Case{"stream", 4, "stream 4, the KV cache has 4 stream(s)"},
                        Case{"n_cached", 30, "n_cached 30 of n_cells 30: nothing left to grant"},
                        Case{"first_cell", 500, "cells 512..530 (end exclusive) of stream 2"},
                        Case{"bytes", 1, "\"bytes\" is 1, the header gives 18432 for cells 28..45 of stream 2"}}) {
    nlohmann::json json = nlohmann::json::parse(to_json(stream_offer()).dump());
    json[c.key] = c.value;
    auto parsed = parse_offer(json, "the test");
    ASSERT_FALSE(parsed) << c.key;
    EXPECT_NE(parsed.error().message().find(c.says), std::string::npos) << parsed.error().message();
  }
  nlohmann::json json = nlohmann::json::parse(to_json(stream_offer()).dump());
  json.erase("first_cell");
  EXPECT_NE(refusal(json).find("field \"first_cell\" is missing"), std::string::npos);
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
