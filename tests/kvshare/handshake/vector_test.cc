// The worked example of docs/protocol.md: tests/data/handshake-share-v1.bin and
// handshake-refuse-v1.bin decode field by field and re-encode to the same bytes.
#include <gtest/gtest.h>

#include <cerrno>
#include <string>

#include "kvshare/handshake/message.h"
#include "layout/share_header.h"
#include "support/test_support.h"

namespace kvshare::handshake {
namespace {

TEST(HandshakeVector, ShareV1DecodesFieldByFieldAndReencodesIdentically) {
  const auto bytes = testing::read_file_bytes(testing::data_path("handshake-share-v1.bin"));
  ASSERT_EQ(bytes.size(), 1602u);
  // Little-endian length 0x0000063e = 1598, then the JSON.
  EXPECT_EQ(bytes[0], std::byte{0x3e});
  EXPECT_EQ(bytes[1], std::byte{0x06});
  auto message = parse_frame(bytes, "handshake-share-v1.bin");
  ASSERT_TRUE(message) << message.error().what();
  EXPECT_EQ(message->version, 1u);
  EXPECT_EQ(message->type, MessageType::share);
  EXPECT_EQ(message->share_id, 1u);
  EXPECT_EQ(message->stream, 0u);  // written before streams: absent reads as 0
  ASSERT_EQ(message->fds.size(), 1u);
  EXPECT_EQ(message->fds[0], (FdEntry{0, "memfd", 0, 262144, 0x2251af64120c772full}));

  auto header = layout::parse_share_header_document(message->header, "handshake-share-v1.bin");
  ASSERT_TRUE(header) << header.error().what();
  EXPECT_EQ(header->model.arch, "llama");
  EXPECT_EQ(header->model.n_layer, 2u);
  EXPECT_EQ(header->model.tensors_hash, 0x5eed5eed5eed5eedull);
  EXPECT_EQ(header->params.n_ctx, 256u);
  EXPECT_EQ(header->params.type_k, layout::GgmlType::F16);
  ASSERT_EQ(header->layout.chunks.size(), 1u);
  EXPECT_EQ(header->layout.chunks[0].size_bytes, message->fds[0].size_bytes);
  EXPECT_EQ(header->layout.chunks[0].layout_hash, message->fds[0].layout_hash);
  ASSERT_EQ(header->layout.tensors.size(), 4u);
  EXPECT_EQ(header->layout.tensors[3].tensor.name, "cache_v_l1");
  EXPECT_EQ(header->layout.tensors[3].offset, 196608u);

  // Re-encode from the decoded values, the header through layout::to_json: the same bytes
  // but for "stream", which a sender now always writes, after "share_id".
  Message again;
  again.share_id = message->share_id;
  again.stream = message->stream;
  again.fds = message->fds;
  again.header_json = layout::to_json(*header, false);
  const std::string old_json(reinterpret_cast<const char*>(bytes.data()) + kLengthBytes, bytes.size() - kLengthBytes);
  std::string with_stream = old_json;
  const std::string after = "\"share_id\":1,";
  ASSERT_NE(with_stream.find(after), std::string::npos);
  with_stream.insert(with_stream.find(after) + after.size(), "\"stream\":0,");
  EXPECT_EQ(encode_json(again), with_stream);
  auto reparsed = parse_json(with_stream, "re-encoded");
  ASSERT_TRUE(reparsed) << reparsed.error().what();
  EXPECT_EQ(reparsed->stream, 0u);
}

// A share of slot 2's stream (issue #27): "stream" round-trips; an older reader's absent
// key and a value past u32 are what the parser distinguishes.
TEST(HandshakeVector, ShareCarriesItsStreamBothWays) {
  Message message;
  message.share_id = 7;
  message.stream = 2;
  message.fds.push_back({0, "memfd", 0, 4096, 0x1});
  message.header_json = "{}";
  const std::string json = encode_json(message);
  EXPECT_NE(json.find("\"share_id\":7,\"stream\":2,\"fds\""), std::string::npos) << json;
  auto parsed = parse_json(json, "stream test");
  ASSERT_TRUE(parsed) << parsed.error().what();
  EXPECT_EQ(parsed->stream, 2u);
  EXPECT_EQ(encode_json(*parsed), std::string(json));

  std::string too_big = json;
  too_big.replace(too_big.find("\"stream\":2"), 10, "\"stream\":4294967296");
  auto refused = parse_json(too_big, "stream test");
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().errno_value(), EINVAL);
  EXPECT_NE(refused.error().message().find("\"stream\" is 4294967296, not an integer 0..4294967295"), std::string::npos)
      << refused.error().what();
}

TEST(HandshakeVector, RefuseV1DecodesAndReencodesIdentically) {
  const auto bytes = testing::read_file_bytes(testing::data_path("handshake-refuse-v1.bin"));
  auto message = parse_frame(bytes, "handshake-refuse-v1.bin");
  ASSERT_TRUE(message) << message.error().what();
  EXPECT_EQ(message->type, MessageType::refuse);
  EXPECT_EQ(message->share_id, 1u);
  EXPECT_EQ(message->field, "params.type_k");
  EXPECT_EQ(message->reason, "field \"params.type_k\" is \"q8_0\", this provider uses \"f16\"");
  EXPECT_EQ(*encode_frame(make_refusal(message->share_id, message->field, message->reason)), bytes);
}

}  // namespace
}  // namespace kvshare::handshake
