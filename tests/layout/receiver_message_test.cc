// The remote receiver's control messages (layout/receiver_message.h, docs/remote.md "The
// receiver process"): the vectors field by field and back to the same bytes, and every
// kind of bad message refused by name.
#include "layout/receiver_message.h"

#include <gtest/gtest.h>

#include <string>

#include "support/test_support.h"

namespace kvshare::layout {
namespace {

std::string vector_text(const std::string& name) {
  const auto bytes = kvshare::testing::read_file_bytes(kvshare::testing::data_path(name));
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

TEST(ReceiverMessage, DecodesTheGrantRequestVectorFieldByFieldAndReencodesItToTheSameBytes) {
  const std::string text = vector_text("receiver-grant-request-v2.json");
  auto request = parse_receiver_request(text, "vector");
  ASSERT_TRUE(request) << request.error().what();
  EXPECT_EQ(request->op, ReceiverOp::grant);
  EXPECT_EQ(request->socket_name, "kvshare-remote-7.sock");
  EXPECT_EQ(request->n_cells, 306u);
  EXPECT_EQ(request->n_cached, 128u);
  EXPECT_EQ(request->timeout_ms, 120000u);
  EXPECT_EQ(encode_receiver_request(*request), text);
}

TEST(ReceiverMessage, DecodesTheGrantReplyVectorFieldByFieldAndReencodesItToTheSameBytes) {
  const std::string text = vector_text("receiver-grant-reply-v2.json");
  auto reply = parse_receiver_reply(text, "vector");
  ASSERT_TRUE(reply) << reply.error().what();
  EXPECT_EQ(reply->op, ReceiverOp::grant);
  EXPECT_TRUE(reply->ok);
  EXPECT_EQ(reply->share_id, 5832004977529186635u);
  EXPECT_TRUE(reply->region_mapped);
  EXPECT_DOUBLE_EQ(reply->region_ms, 1.25);
  EXPECT_EQ(reply->offer["transport"], "ucx");
  EXPECT_EQ(reply->offer["version"], 3);
  EXPECT_EQ(encode_receiver_reply(*reply), text);
}

TEST(ReceiverMessage, DecodesARefusalVectorWithItsErrnoAndSentence) {
  const std::string text = vector_text("receiver-complete-refused-v2.json");
  auto reply = parse_receiver_reply(text, "vector");
  ASSERT_TRUE(reply) << reply.error().what();
  EXPECT_EQ(reply->op, ReceiverOp::complete);
  EXPECT_FALSE(reply->ok);
  EXPECT_EQ(reply->error_errno, 5);
  EXPECT_NE(reply->error.find("partial transfer"), std::string::npos);
  EXPECT_EQ(encode_receiver_reply(*reply), text);
}

TEST(ReceiverMessage, DecodesTheRevokeRequestVectorNamingASocketAndAGrant) {
  const std::string text = vector_text("receiver-revoke-request-v2.json");
  auto request = parse_receiver_request(text, "vector");
  ASSERT_TRUE(request) << request.error().what();
  EXPECT_EQ(request->op, ReceiverOp::revoke);
  EXPECT_EQ(request->socket_name, "kvshare-remote-7.sock");
  EXPECT_EQ(request->grant_id, 10910776035468251147u);
  EXPECT_EQ(request->why, "the handoff failed");
  EXPECT_EQ(encode_receiver_request(*request), text);
}

TEST(ReceiverMessage, RefusesAVersion1MessageNamingBothVersions) {
  auto refused = parse_receiver_request(R"({"version":1,"op":"grant","n_cells":306,"timeout_ms":120000})", "test");
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().errno_value(), EPROTO);
  EXPECT_NE(refused.error().message().find("protocol version 1, this side speaks 2"), std::string::npos);
}

TEST(ReceiverMessage, RefusesAGrantWithoutASocketOrThatLeavesNothingToGrant) {
  auto no_socket =
      parse_receiver_request(R"({"version":2,"op":"grant","n_cells":3,"n_cached":0,"timeout_ms":5})", "test");
  ASSERT_FALSE(no_socket);
  EXPECT_NE(no_socket.error().message().find("\"socket\""), std::string::npos) << no_socket.error().message();
  auto all_cached = parse_receiver_request(
      R"({"version":2,"op":"grant","socket":"a.sock","n_cells":3,"n_cached":3,"timeout_ms":5})", "test");
  ASSERT_FALSE(all_cached);
  EXPECT_NE(all_cached.error().message().find("\"n_cached\" is 3 of \"n_cells\" 3"), std::string::npos)
      << all_cached.error().message();
  auto slash = parse_receiver_request(
      R"({"version":2,"op":"grant","socket":"../a.sock","n_cells":3,"n_cached":0,"timeout_ms":5})", "test");
  ASSERT_FALSE(slash);
  EXPECT_EQ(slash.error().errno_value(), EINVAL);
}

TEST(ReceiverMessage, RefusesARevokeOfGrant0OrABadSocketName) {
  EXPECT_FALSE(parse_receiver_request(R"({"version":2,"op":"revoke","grant_id":0,"why":"x"})", "test"));
  EXPECT_FALSE(parse_receiver_request(R"({"version":2,"op":"revoke","socket":"a/b","why":"x"})", "test"));
  auto everything = parse_receiver_request(R"({"version":2,"op":"revoke","why":"serve stops"})", "test");
  ASSERT_TRUE(everything) << everything.error().what();
  EXPECT_TRUE(everything->socket_name.empty());
  EXPECT_EQ(everything->grant_id, 0u);
}

TEST(ReceiverMessage, RoundTripsEveryRequest) {
  ReceiverRequest listen{.op = ReceiverOp::listen, .socket_name = "kvshare-remote-3.sock"};
  ReceiverRequest grant{
      .op = ReceiverOp::grant, .socket_name = "kvshare-remote-3.sock", .n_cells = 40, .n_cached = 12, .timeout_ms = 9};
  ReceiverRequest complete{.op = ReceiverOp::complete, .grant_id = 77, .n_tokens = 9};
  ReceiverRequest revoke{.op = ReceiverOp::revoke, .why = "the handoff failed"};
  ReceiverRequest revoke_one{
      .op = ReceiverOp::revoke, .socket_name = "kvshare-remote-3.sock", .grant_id = 77, .why = "the handoff failed"};
  for (const ReceiverRequest& request : {listen, grant, complete, revoke, revoke_one}) {
    auto back = parse_receiver_request(encode_receiver_request(request), "test");
    ASSERT_TRUE(back) << back.error().what();
    EXPECT_EQ(back->op, request.op);
    EXPECT_EQ(back->socket_name, request.socket_name);
    EXPECT_EQ(back->n_cells, request.n_cells);
    EXPECT_EQ(back->n_cached, request.n_cached);
    EXPECT_EQ(back->timeout_ms, request.timeout_ms);
    EXPECT_EQ(back->grant_id, request.grant_id);
    EXPECT_EQ(back->n_tokens, request.n_tokens);
    EXPECT_EQ(back->why, request.why);
  }
}

TEST(ReceiverMessage, RoundTripsHelloListenCompleteAndRevokeReplies) {
  ReceiverReply hello{.op = ReceiverOp::hello, .pid = 4121};
  ReceiverReply listen{.op = ReceiverOp::listen, .socket_path = "/tmp/x/kvshare-remote-3.sock"};
  ReceiverReply complete{.op = ReceiverOp::complete, .bytes_received = 9728};
  ReceiverReply revoke{.op = ReceiverOp::revoke};
  for (const ReceiverReply& reply : {hello, listen, complete, revoke}) {
    auto back = parse_receiver_reply(encode_receiver_reply(reply), "test");
    ASSERT_TRUE(back) << back.error().what();
    EXPECT_EQ(back->op, reply.op);
    EXPECT_EQ(back->pid, reply.pid);
    EXPECT_EQ(back->socket_path, reply.socket_path);
    EXPECT_EQ(back->bytes_received, reply.bytes_received);
  }
}

struct Refusal {
  const char* text;
  int errno_value;
  const char* words;
};

TEST(ReceiverMessage, RefusesEveryMalformedRequestNamingTheField) {
  const Refusal cases[] = {
      {"", EINVAL, "not JSON"},
      {"[1]", EINVAL, "not a JSON object"},
      {R"({"op":"grant","socket":"a.sock","n_cells":1,"timeout_ms":1})", EINVAL, "no \"version\""},
      {R"({"version":3,"op":"grant","socket":"a.sock","n_cells":1,"timeout_ms":1})", EPROTO, "protocol version 3"},
      {R"({"version":2,"op":"format"})", EINVAL, "\"op\" is \"format\""},
      {R"({"version":2,"op":7})", EINVAL, "\"op\" is 7, not a string"},
      {R"({"version":2,"op":"hello"})", EINVAL, "the receiver's word"},
      {R"({"version":2,"op":"listen","socket":"../x"})", EINVAL, "no '/'"},
      {R"({"version":2,"op":"listen","socket":""})", EINVAL, "\"socket\" must be a file name"},
      {R"({"version":2,"op":"listen"})", EINVAL, "no \"socket\""},
      {R"({"version":2,"op":"grant","socket":"a.sock","n_cells":0,"n_cached":0,"timeout_ms":1})", EINVAL,
       "\"n_cells\" is 0"},
      {R"({"version":2,"op":"grant","socket":"a.sock","n_cells":-1,"timeout_ms":1})", EINVAL,
       "not an unsigned integer"},
      {R"({"version":2,"op":"grant","socket":"a.sock","n_cells":4294967296,"timeout_ms":1})", EINVAL, "past 2^32-1"},
      {R"({"version":2,"op":"grant","socket":"a.sock","n_cells":3,"n_cached":0,"timeout_ms":0})", EINVAL,
       "\"timeout_ms\" is 0"},
      {R"({"version":2,"op":"complete","n_tokens":3})", EINVAL, "no \"grant_id\""},
      {R"({"version":2,"op":"revoke","why":null})", EINVAL, "\"why\" is null"},
  };
  for (const Refusal& c : cases) {
    auto parsed = parse_receiver_request(c.text, "serve");
    ASSERT_FALSE(parsed) << c.text;
    EXPECT_EQ(parsed.error().errno_value(), c.errno_value) << c.text;
    EXPECT_NE(parsed.error().what().find(c.words), std::string::npos) << c.text << ": " << parsed.error().what();
    EXPECT_NE(parsed.error().what().find("serve"), std::string::npos) << parsed.error().what();
  }
}

TEST(ReceiverMessage, RefusesEveryMalformedReplyNamingTheField) {
  const Refusal cases[] = {
      {R"({"version":2,"op":"listen","ok":true,"socket":"relative.sock"})", EINVAL, "not an absolute path"},
      {R"({"version":2,"op":"listen","ok":"yes","socket":"/a"})", EINVAL, "not true or false"},
      {R"({"version":2,"op":"grant","ok":true,"share_id":1,"region":"new","region_ms":0,"offer":{}})", EINVAL,
       "\"region\" is \"new\""},
      {R"({"version":2,"op":"grant","ok":true,"share_id":1,"region":"kept","region_ms":0,"offer":[]})", EINVAL,
       "\"offer\" is not an object"},
      {R"({"version":2,"op":"complete","ok":false,"error":"x"})", EINVAL, "no \"errno\""},
      {R"({"version":2,"op":"complete","ok":false,"errno":0,"error":"x"})", EINVAL, "not an errno value 1..4095"},
      {R"({"version":2,"op":"complete","ok":false,"errno":70000,"error":"x"})", EINVAL, "not an errno value 1..4095"},
      {R"({"version":2,"op":"hello","ok":true})", EINVAL, "no \"pid\""},
  };
  for (const Refusal& c : cases) {
    auto parsed = parse_receiver_reply(c.text, "kvshare-remote-receiver");
    ASSERT_FALSE(parsed) << c.text;
    EXPECT_EQ(parsed.error().errno_value(), c.errno_value) << c.text;
    EXPECT_NE(parsed.error().what().find(c.words), std::string::npos) << c.text << ": " << parsed.error().what();
  }
}

TEST(ReceiverMessage, RefusesAnOversizedOrTooDeeplyNestedMessageBeforeParsing) {
  const std::string big(kMaxReceiverMessageBytes + 1, ' ');
  auto oversized = parse_receiver_reply(big, "peer");
  ASSERT_FALSE(oversized);
  EXPECT_EQ(oversized.error().errno_value(), EMSGSIZE);
  const std::string deep =
      R"({"version":2,"op":"revoke","why":"x","n":)" + std::string(100, '[') + std::string(100, ']') + "}";
  auto nested = parse_receiver_request(deep, "peer");
  ASSERT_FALSE(nested);
  EXPECT_NE(nested.error().what().find("nests deeper"), std::string::npos) << nested.error().what();
}

}  // namespace
}  // namespace kvshare::layout
