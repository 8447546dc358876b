#include "kvshare/handshake/message.h"

#include <gtest/gtest.h>

#include <cstring>

namespace kvshare::handshake {
namespace {

Message share_message() {
  Message message;
  message.share_id = 7;
  message.fds = {{0, "memfd", 0, 65536, 0x0123456789abcdefull}, {1, "udmabuf", 4096, 8192, 0xfedcba9876543210ull}};
  message.header_json = R"({"format_version":1,"model":{"arch":"qwen3moe"}})";
  return message;
}

std::string json_of(const Message& message) { return encode_json(message); }

// Replaces the first occurrence of `from` in the encoded message.
std::string edited(const Message& message, const std::string& from, const std::string& to) {
  std::string json = json_of(message);
  const auto at = json.find(from);
  EXPECT_NE(at, std::string::npos) << from << " not in " << json;
  return json.replace(at, from.size(), to);
}

void expect_refused(std::string_view json, int errno_value, const std::string& words) {
  auto parsed = parse_json(json, "pid 4121");
  ASSERT_FALSE(parsed) << json;
  EXPECT_EQ(parsed.error().errno_value(), errno_value) << parsed.error().message();
  EXPECT_NE(parsed.error().message().find(words), std::string::npos) << parsed.error().message();
  EXPECT_NE(parsed.error().message().find("handshake from pid 4121"), std::string::npos);
}

TEST(HandshakeMessage, RoundTripsAShareMessageFieldByField) {
  const Message message = share_message();
  auto parsed = parse_json(json_of(message), "test");
  ASSERT_TRUE(parsed) << parsed.error().what();
  EXPECT_EQ(parsed->version, kProtocolVersion);
  EXPECT_EQ(parsed->type, MessageType::share);
  EXPECT_EQ(parsed->share_id, 7u);
  EXPECT_EQ(parsed->fds, message.fds);
  EXPECT_TRUE(parsed->header_json.empty());  // a received header is the parsed object
  EXPECT_EQ(parsed->header.dump(), message.header_json);
  EXPECT_EQ(json_of(*parsed), json_of(message));
}

// Issue #27: a share of a run of cells (a unified cache of several slots) names it; a
// share of the whole stream writes neither field, as before.
TEST(HandshakeMessage, RoundTripsTheRunOfCellsAndWritesItOnlyWhenNamed) {
  Message message = share_message();
  EXPECT_EQ(json_of(message).find("cell"), std::string::npos);
  message.first_cell = 100;
  message.n_cells = 40;
  const std::string json = json_of(message);
  EXPECT_NE(json.find(R"("stream":0,"first_cell":100,"n_cells":40,"fds")"), std::string::npos) << json;
  auto parsed = parse_json(json, "test");
  ASSERT_TRUE(parsed) << parsed.error().what();
  EXPECT_EQ(parsed->first_cell, 100u);
  EXPECT_EQ(parsed->n_cells, 40u);
  EXPECT_EQ(json_of(*parsed), json);
  expect_refused(edited(message, R"("n_cells":40)", R"("n_cells":-1)"), EINVAL, "n_cells");
}

TEST(HandshakeMessage, SkipsAHeaderWhoseBytesAreTheKnownOnesAndParsesAnyOtherInFull) {
  const Message message = share_message();
  const std::string json = json_of(message);
  // The known header: only the envelope is parsed.
  auto known = parse_json(json, "test", message.header_json);
  ASSERT_TRUE(known) << known.error().what();
  EXPECT_TRUE(known->header_is_known);
  EXPECT_TRUE(known->header.is_null());
  EXPECT_EQ(known->share_id, 7u);
  EXPECT_EQ(known->fds, message.fds);
  // A different known header: parsed in full.
  auto other = parse_json(json, "test", R"({"format_version":1})");
  ASSERT_TRUE(other) << other.error().what();
  EXPECT_FALSE(other->header_is_known);
  EXPECT_EQ(other->header.dump(), message.header_json);
  // An envelope with a "header" of its own before the known one: the full parse decides
  // (the last "header" wins in nlohmann, as in any full parse), never the shortcut.
  std::string twice = json;
  twice.insert(1, R"("header":{"format_version":2},)");
  auto doubled = parse_json(twice, "test", message.header_json);
  ASSERT_TRUE(doubled) << doubled.error().what();
  EXPECT_FALSE(doubled->header_is_known);
  // The known bytes at the end of a message whose envelope is not a whole object (an open
  // string swallows them): refused as invalid JSON, exactly as without the shortcut.
  const std::string open_string = R"({"kvshare_handshake":1,"type":"share","share_id":7,"x":")" +
                                  std::string(",\"header\":") + message.header_json + "}";
  auto broken = parse_json(open_string, "test", message.header_json);
  ASSERT_FALSE(broken);
  EXPECT_EQ(broken.error().errno_value(), EINVAL);
  // A refusal whose envelope parses: the shortcut gives what the full parse gives.
  auto refused =
      parse_json(R"({"kvshare_handshake":1,"type":"share","share_id":0,"fds":[],"header":)" + message.header_json + "}",
                 "test", message.header_json);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message().find("share_id"), std::string::npos) << refused.error().message();
}

TEST(HandshakeMessage, WritesTheLayoutHashAsSixteenHexDigits) {
  EXPECT_NE(json_of(share_message()).find(R"("layout_hash":"0x0123456789abcdef")"), std::string::npos);
}

TEST(HandshakeMessage, RoundTripsARefusalNamingTheField) {
  const Message refusal =
      make_refusal(3, "params.type_k", "field \"params.type_k\" is \"q8_0\", this decoder uses \"f16\"");
  auto parsed = parse_json(json_of(refusal), "test");
  ASSERT_TRUE(parsed) << parsed.error().what();
  EXPECT_EQ(parsed->type, MessageType::refuse);
  EXPECT_EQ(parsed->share_id, 3u);
  EXPECT_EQ(parsed->field, "params.type_k");
  EXPECT_EQ(parsed->reason, refusal.reason);
  EXPECT_TRUE(parsed->fds.empty());
}

TEST(HandshakeMessage, FramesWithALittleEndianLength) {
  auto frame = encode_frame(share_message());
  ASSERT_TRUE(frame);
  const std::string json = json_of(share_message());
  ASSERT_EQ(frame->size(), 4 + json.size());
  EXPECT_EQ(static_cast<size_t>(frame->at(0)) | static_cast<size_t>(frame->at(1)) << 8, json.size() & 0xffff);
  auto parsed = parse_frame(*frame, "test");
  ASSERT_TRUE(parsed) << parsed.error().what();
  EXPECT_EQ(parsed->share_id, 7u);
}

TEST(HandshakeMessage, RefusesJsonThatIsNotAKvshareMessage) {
  expect_refused(R"({"type":"share"})", EINVAL, "no field \"kvshare_handshake\"");
  expect_refused(R"([1,2])", EINVAL, "expected a JSON object");
  expect_refused(R"({"kvshare_handshake":1,)", EINVAL, "not valid JSON");
}

TEST(HandshakeMessage, RefusesANewerVersionByName) {
  expect_refused(edited(share_message(), R"("kvshare_handshake":1)", R"("kvshare_handshake":2)"), EPROTO,
                 "field \"kvshare_handshake\" is 2, this side speaks version 1");
}

TEST(HandshakeMessage, RefusesAnUnknownType) {
  expect_refused(edited(share_message(), R"("type":"share")", R"("type":"adopt")"), EINVAL,
                 "field \"type\" is \"adopt\"");
}

TEST(HandshakeMessage, RefusesAShareWithoutAShareId) {
  expect_refused(edited(share_message(), R"("share_id":7)", R"("share_id":0)"), EINVAL, "field \"share_id\" is 0");
  expect_refused(edited(share_message(), R"("share_id":7)", R"("share_id":-1)"), EINVAL,
                 "\"share_id\" is -1, not an unsigned integer");
}

TEST(HandshakeMessage, RefusesFdsOutOfChunkOrder) {
  expect_refused(edited(share_message(), R"("chunk":1)", R"("chunk":5)"), EINVAL,
                 "field \"fds[1].chunk\" is 5, expected 1");
}

TEST(HandshakeMessage, RefusesAnUnknownFdKind) {
  expect_refused(edited(share_message(), R"("kind":"udmabuf")", R"("kind":"shm")"), EINVAL,
                 "field \"fds[1].kind\" is \"shm\"");
}

TEST(HandshakeMessage, RefusesAnUnalignedOffsetOrSize) {
  expect_refused(edited(share_message(), R"("offset":4096)", R"("offset":100)"), EINVAL,
                 "field \"fds[1].offset\" is 100");
  expect_refused(edited(share_message(), R"("size_bytes":8192)", R"("size_bytes":0)"), EINVAL,
                 "field \"fds[1].size_bytes\" is 0");
}

TEST(HandshakeMessage, RefusesAMalformedLayoutHash) {
  expect_refused(edited(share_message(), "0x0123456789abcdef", "0x0123"), EINVAL, "field \"fds[0].layout_hash\"");
  expect_refused(edited(share_message(), R"("layout_hash":"0x0123456789abcdef")", R"("layout_hash":81985529216486895)"),
                 EINVAL, "\"fds[0].layout_hash\" is 81985529216486895, not a string");
}

TEST(HandshakeMessage, RefusesAShareWithNoFdsOrMoreThanScmMaxFd) {
  expect_refused(R"({"kvshare_handshake":1,"type":"share","share_id":1,"fds":[],"header":{}})", EINVAL,
                 "field \"fds\" must be an array of 1..253");
  std::string many = R"({"kvshare_handshake":1,"type":"share","share_id":1,"fds":[)";
  for (int i = 0; i < 254; ++i)
    many += fmt::format(
        R"({}{{"chunk":{},"kind":"memfd","offset":0,"size_bytes":4096,"layout_hash":"0x0000000000000000"}})",
        i ? "," : "", i);
  many += R"(],"header":{}})";
  expect_refused(many, EINVAL, "1..253");
}

TEST(HandshakeMessage, RefusesAHeaderThatIsNotAnObject) {
  std::string json = json_of(share_message());
  json = json.substr(0, json.find(R"("header":)")) + R"("header":"layout.json"})";
  expect_refused(json, EINVAL, "field \"header\" is string");
}

TEST(HandshakeMessage, RefusesARefusalWithoutAReason) {
  expect_refused(R"({"kvshare_handshake":1,"type":"refuse","share_id":0,"field":"","reason":""})", EINVAL,
                 "field \"reason\" is empty");
  expect_refused(R"({"kvshare_handshake":1,"type":"refuse","share_id":0,"field":""})", EINVAL, "no \"reason\"");
}

TEST(HandshakeMessage, RefusesDeepNestingBeforeParsing) {
  std::string json = R"({"kvshare_handshake":1,"x":)" + std::string(100, '[') + std::string(100, ']') + "}";
  expect_refused(json, EINVAL, "nests deeper than 32 levels");
}

TEST(HandshakeMessage, RefusesAFrameWhoseLengthDisagreesWithItsBytes) {
  auto frame = *encode_frame(share_message());
  frame.pop_back();
  auto parsed = parse_frame(frame, "test");
  ASSERT_FALSE(parsed);
  EXPECT_EQ(parsed.error().errno_value(), EPROTO);
  EXPECT_NE(parsed.error().message().find("the frame carries"), std::string::npos);
}

TEST(HandshakeMessage, RefusesALengthOverTheCap) {
  std::vector<std::byte> frame(8, std::byte{0});
  frame[2] = std::byte{0x20};  // 0x200000 = 2 MiB
  auto parsed = parse_frame(frame, "test");
  ASSERT_FALSE(parsed);
  EXPECT_EQ(parsed.error().errno_value(), EMSGSIZE);
  EXPECT_NE(parsed.error().message().find("2097152 bytes, the limit is 1048576"), std::string::npos);
}

TEST(HandshakeMessage, RefusesToEncodeAMessageOverTheCap) {
  Message message = make_refusal(1, "", std::string(kMaxMessageBytes, 'x'));
  auto frame = encode_frame(message);
  ASSERT_FALSE(frame);
  EXPECT_EQ(frame.error().errno_value(), EMSGSIZE);
}

}  // namespace
}  // namespace kvshare::handshake
