// The resident provider protocol (kvshare/share/provider_protocol.h, docs/provider.md "The
// resident provider"): the vectors field by field and back to the same bytes, round trips,
// and every kind of bad message refused with its errno and the field named.
#include "kvshare/share/provider_protocol.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <string>
#include <string_view>
#include <vector>

#include "kvshare/handshake/message.h"
#include "layout/share_header.h"
#include "support/test_support.h"

namespace kvshare {
namespace {

std::string vector_text(const std::string& name) {
  const auto bytes = testing::read_file_bytes(testing::data_path(name));
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

// The JSON of tests/data/handshake-share-v1.bin: the share a region request carries.
std::string handshake_share_json() {
  const auto bytes = testing::read_file_bytes(testing::data_path("handshake-share-v1.bin"));
  const auto* json = reinterpret_cast<const char*>(bytes.data()) + handshake::kLengthBytes;
  return {json, bytes.size() - handshake::kLengthBytes};
}

// `text` as a sender writes it now: "stream":0 after `after` (a vector from before streams,
// whose shares and shared prefills were all stream 0's).
std::string with_stream_zero(std::string text, const std::string& after) {
  const size_t at = text.find(after);
  EXPECT_NE(at, std::string::npos) << after;
  if (at != std::string::npos) text.insert(at + after.size(), "\"stream\":0,");
  return text;
}

const std::vector<int32_t> kVectorTokens{1, 15043, 29892, 920, 526, 366};

TEST(ProviderProtocol, DecodesTheHelloReplyVectorFieldByFieldAndReencodesItToTheSameBytes) {
  const std::string text = vector_text("provider-hello-reply-v1.json");
  auto reply = parse_provider_reply(text, "vector");
  ASSERT_TRUE(reply) << reply.error().what();
  EXPECT_EQ(reply->op, ProviderOp::hello);
  EXPECT_TRUE(reply->ok);
  EXPECT_EQ(reply->pid, 4121u);
  EXPECT_TRUE(reply->takes_shared);
  EXPECT_TRUE(reply->takes_file);
  EXPECT_TRUE(reply->takes_cached);
  EXPECT_EQ(encode_provider_reply(*reply), text);
}

TEST(ProviderProtocol, DecodesTheRegionRequestVectorFieldByFieldAndReencodesItToTheSameBytes) {
  const std::string text = vector_text("provider-region-request-v1.json");
  auto request = parse_provider_request(text, "vector");
  ASSERT_TRUE(request) << request.error().what();
  EXPECT_EQ(request->op, ProviderOp::region);
  EXPECT_EQ(request->region_id, 1u);
  const handshake::Message& share = request->share;
  EXPECT_EQ(share.type, handshake::MessageType::share);
  EXPECT_EQ(share.version, 1u);
  EXPECT_EQ(share.share_id, 1u);
  ASSERT_EQ(share.fds.size(), 1u);
  EXPECT_EQ(share.fds[0], (handshake::FdEntry{0, "memfd", 0, 262144, 0x2251af64120c772full}));
  auto header = layout::parse_share_header_document(share.header, "vector");
  ASSERT_TRUE(header) << header.error().what();
  EXPECT_EQ(header->model.arch, "llama");
  EXPECT_EQ(header->model.n_layer, 2u);
  EXPECT_EQ(header->params.n_ctx, 256u);
  ASSERT_EQ(header->layout.chunks.size(), 1u);
  EXPECT_EQ(header->layout.chunks[0].size_bytes, share.fds[0].size_bytes);
  EXPECT_EQ(header->layout.chunks[0].layout_hash, share.fds[0].layout_hash);
  EXPECT_EQ(share.stream, 0u);
  // The share is the handshake vector's JSON, spliced as it is, with the "stream" a
  // decoder now always writes.
  EXPECT_EQ(handshake::encode_json(share), with_stream_zero(handshake_share_json(), "\"share_id\":1,"));
  EXPECT_EQ(encode_provider_request(*request), with_stream_zero(text, "\"share_id\":1,"));
  // And from the decoded values, the header through layout::to_json as a decoder sends it.
  ProviderRequest again{.op = ProviderOp::region, .region_id = 1};
  again.share.share_id = 1;
  again.share.fds = share.fds;
  again.share.header_json = layout::to_json(*header, false);
  EXPECT_EQ(encode_provider_request(again), with_stream_zero(text, "\"share_id\":1,"));
}

TEST(ProviderProtocol, DecodesTheRegionReplyVectorFieldByFieldAndReencodesItToTheSameBytes) {
  const std::string text = vector_text("provider-region-reply-v1.json");
  auto reply = parse_provider_reply(text, "vector");
  ASSERT_TRUE(reply) << reply.error().what();
  EXPECT_EQ(reply->op, ProviderOp::region);
  EXPECT_TRUE(reply->ok);
  EXPECT_EQ(reply->region_id, 1u);
  EXPECT_DOUBLE_EQ(reply->region_ms, 0.75);
  EXPECT_EQ(encode_provider_reply(*reply), text);
}

TEST(ProviderProtocol, DecodesTheSharedPrefillRequestVectorFieldByFieldAndReencodesItToTheSameBytes) {
  const std::string text = vector_text("provider-prefill-shared-request-v1.json");
  auto request = parse_provider_request(text, "vector");
  ASSERT_TRUE(request) << request.error().what();
  EXPECT_EQ(request->op, ProviderOp::prefill);
  EXPECT_EQ(request->route, PrefillRoute::shared);
  EXPECT_EQ(request->region_id, 1u);
  EXPECT_EQ(request->share_id, 2u);
  EXPECT_EQ(request->n_cached, 3u);
  EXPECT_EQ(request->stream, 0u);  // from before streams: absent reads as 0
  EXPECT_EQ(request->tokens, kVectorTokens);
  EXPECT_EQ(encode_provider_request(*request), with_stream_zero(text, "\"share_id\":2,"));
}

TEST(ProviderProtocol, DecodesTheSharedPrefillOfStream2VectorAndReencodesItToTheSameBytes) {
  const std::string text = vector_text("provider-prefill-shared-stream-request-v1.json");
  auto request = parse_provider_request(text, "vector");
  ASSERT_TRUE(request) << request.error().what();
  EXPECT_EQ(request->route, PrefillRoute::shared);
  EXPECT_EQ(request->region_id, 1u);
  EXPECT_EQ(request->share_id, 2u);
  EXPECT_EQ(request->stream, 2u);
  EXPECT_EQ(request->n_cached, 3u);
  EXPECT_EQ(request->tokens, kVectorTokens);
  EXPECT_EQ(encode_provider_request(*request), text);
}

// Issue #27, a unified cache: the share's run of cells travels with the prefill.
TEST(ProviderProtocol, DecodesTheSharedPrefillOfARunOfCellsVectorAndReencodesItToTheSameBytes) {
  const std::string text = vector_text("provider-prefill-shared-cells-request-v1.json");
  auto request = parse_provider_request(text, "vector");
  ASSERT_TRUE(request) << request.error().what();
  EXPECT_EQ(request->route, PrefillRoute::shared);
  EXPECT_EQ(request->share_id, 3u);
  EXPECT_EQ(request->stream, 0u);
  EXPECT_EQ(request->first_cell, 100u);
  EXPECT_EQ(request->n_cells, 40u);
  EXPECT_EQ(request->n_cached, 0u);
  EXPECT_EQ(request->tokens, kVectorTokens);
  EXPECT_EQ(encode_provider_request(*request), text);

  // No range: neither field is written, and an older vector reads as the whole stream.
  request->first_cell = 0;
  request->n_cells = 0;
  EXPECT_EQ(encode_provider_request(*request).find("cell"), std::string::npos);
  auto older = parse_provider_request(vector_text("provider-prefill-shared-stream-request-v1.json"), "vector");
  ASSERT_TRUE(older) << older.error().what();
  EXPECT_EQ(older->first_cell, 0u);
  EXPECT_EQ(older->n_cells, 0u);

  nlohmann::ordered_json json = nlohmann::ordered_json::parse(text);
  json.erase("n_cells");
  auto refused = parse_provider_request(json.dump(), "serve");
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().errno_value(), EINVAL);
  EXPECT_NE(refused.error().message().find("\"first_cell\" is 100 without \"n_cells\""), std::string::npos)
      << refused.error().what();
}

TEST(ProviderProtocol, RefusesAStreamThatIsNotAU32NamingIt) {
  nlohmann::ordered_json json =
      nlohmann::ordered_json::parse(vector_text("provider-prefill-shared-stream-request-v1.json"));
  json["stream"] = -1;
  auto refused = parse_provider_request(json.dump(), "serve");
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().errno_value(), EINVAL);
  EXPECT_NE(refused.error().message().find("\"stream\""), std::string::npos) << refused.error().what();
}

TEST(ProviderProtocol, DecodesTheFilePrefillRequestVectorFieldByFieldAndReencodesItToTheSameBytes) {
  const std::string text = vector_text("provider-prefill-file-request-v1.json");
  auto request = parse_provider_request(text, "vector");
  ASSERT_TRUE(request) << request.error().what();
  EXPECT_EQ(request->op, ProviderOp::prefill);
  EXPECT_EQ(request->route, PrefillRoute::file);
  EXPECT_EQ(request->state_file, "/tmp/kvshare-serve-slots-Q2x9Lk/kvshare-request-7.state");
  EXPECT_EQ(request->state_version, 3u);
  EXPECT_EQ(request->kv, (ProviderKvParams{4096, "q8_0", "q8_0", true}));
  EXPECT_EQ(request->tokens, kVectorTokens);
  EXPECT_EQ(request->n_cached, 0u);
  EXPECT_EQ(encode_provider_request(*request), text);
}

TEST(ProviderProtocol, DecodesThePrefillReplyVectorFieldByFieldAndReencodesItToTheSameBytes) {
  const std::string text = vector_text("provider-prefill-reply-v1.json");
  auto reply = parse_provider_reply(text, "vector");
  ASSERT_TRUE(reply) << reply.error().what();
  EXPECT_EQ(reply->op, ProviderOp::prefill);
  EXPECT_TRUE(reply->ok);
  EXPECT_DOUBLE_EQ(reply->prefill_ms, 3.25);
  EXPECT_EQ(reply->n_prefilled, 3u);
  EXPECT_EQ(encode_provider_reply(*reply), text);
}

TEST(ProviderProtocol, DecodesTheStaleRegionRefusalVectorWithItsErrnoAndSentence) {
  const std::string text = vector_text("provider-prefill-refused-v1.json");
  auto reply = parse_provider_reply(text, "vector");
  ASSERT_TRUE(reply) << reply.error().what();
  EXPECT_EQ(reply->op, ProviderOp::prefill);
  EXPECT_FALSE(reply->ok);
  EXPECT_EQ(reply->error_errno, ESTALE);
  EXPECT_EQ(reply->error, "prefill of share 3 on region_id 2: this provider holds no region (send the region again)");
  EXPECT_EQ(encode_provider_reply(*reply), text);
}

TEST(ProviderProtocol, RoundTripsBothPrefillRoutes) {
  const ProviderRequest shared{.op = ProviderOp::prefill,
                               .region_id = 9,
                               .route = PrefillRoute::shared,
                               .share_id = 12,
                               .n_cached = 0,
                               .tokens = {0, 2147483647}};
  const ProviderRequest file{.op = ProviderOp::prefill,
                             .route = PrefillRoute::file,
                             .tokens = {7},
                             .state_file = "/a b/\"quoted\".state",
                             .state_version = 0,
                             .kv = {1u << 20, "q4_0", "f16", false}};
  for (const ProviderRequest& request : {shared, file}) {
    auto back = parse_provider_request(encode_provider_request(request), "test");
    ASSERT_TRUE(back) << back.error().what();
    EXPECT_EQ(back->op, request.op);
    EXPECT_EQ(back->route, request.route);
    EXPECT_EQ(back->region_id, request.region_id);
    EXPECT_EQ(back->share_id, request.share_id);
    EXPECT_EQ(back->n_cached, request.n_cached);
    EXPECT_EQ(back->tokens, request.tokens);
    EXPECT_EQ(back->state_file, request.state_file);
    EXPECT_EQ(back->state_version, request.state_version);
    EXPECT_EQ(back->kv, request.kv);
  }
}

TEST(ProviderProtocol, RoundTripsARegionRequestWhoseHeaderIsAnObject) {
  auto share = handshake::parse_json(handshake_share_json(), "test");
  ASSERT_TRUE(share) << share.error().what();
  ProviderRequest request{.op = ProviderOp::region, .region_id = (uint64_t{1} << 53) - 1, .share = *share};
  auto back = parse_provider_request(encode_provider_request(request), "test");
  ASSERT_TRUE(back) << back.error().what();
  EXPECT_EQ(back->region_id, request.region_id);
  EXPECT_EQ(back->share.fds, share->fds);
  EXPECT_EQ(back->share.header, share->header);
}

TEST(ProviderProtocol, RoundTripsEveryReply) {
  const ProviderReply hello_shared_only{.op = ProviderOp::hello, .pid = 77, .takes_file = false, .takes_cached = false};
  const ProviderReply hello_file_only{.op = ProviderOp::hello, .pid = 78, .takes_shared = false};
  const ProviderReply region{.op = ProviderOp::region, .region_id = 3, .region_ms = 12.5};
  const ProviderReply prefill{.op = ProviderOp::prefill, .prefill_ms = 0, .n_prefilled = 4294967295u};
  const ProviderReply refused{.op = ProviderOp::region,
                              .ok = false,
                              .error_errno = ENOMEM,
                              .error = "mmap of chunk 0 (262144 bytes): \"quoted\"\nsecond line"};
  for (const ProviderReply& reply : {hello_shared_only, hello_file_only, region, prefill, refused}) {
    const std::string text = encode_provider_reply(reply);
    auto back = parse_provider_reply(text, "test");
    ASSERT_TRUE(back) << back.error().what();
    EXPECT_EQ(back->op, reply.op) << text;
    EXPECT_EQ(back->ok, reply.ok) << text;
    EXPECT_EQ(back->error_errno, reply.error_errno) << text;
    EXPECT_EQ(back->error, reply.error) << text;
    EXPECT_EQ(back->pid, reply.pid) << text;
    EXPECT_EQ(back->takes_shared, reply.takes_shared) << text;
    EXPECT_EQ(back->takes_file, reply.takes_file) << text;
    EXPECT_EQ(back->takes_cached, reply.takes_cached) << text;
    EXPECT_EQ(back->region_id, reply.region_id) << text;
    EXPECT_DOUBLE_EQ(back->region_ms, reply.region_ms) << text;
    EXPECT_DOUBLE_EQ(back->prefill_ms, reply.prefill_ms) << text;
    EXPECT_EQ(back->n_prefilled, reply.n_prefilled) << text;
  }
}

struct Refusal {
  std::string text;
  int errno_value;
  const char* words;
};

// Each case refused with its errno, the distinguishing words and the source named.
template <class Parse>
void expect_refused(const std::vector<Refusal>& cases, Parse parse, std::string_view source) {
  for (const Refusal& c : cases) {
    auto parsed = parse(c.text, source);
    if (parsed) {
      ADD_FAILURE() << "accepted: " << c.text;
      continue;
    }
    EXPECT_EQ(parsed.error().errno_value(), c.errno_value) << c.text << ": " << parsed.error().what();
    EXPECT_NE(parsed.error().message().find(c.words), std::string::npos) << c.text << ": " << parsed.error().what();
    EXPECT_NE(parsed.error().message().find(source), std::string::npos) << parsed.error().what();
  }
}

void expect_request_refusals(const std::vector<Refusal>& cases) {
  expect_refused(cases, parse_provider_request, "kvshare-serve (pid 1)");
}

void expect_reply_refusals(const std::vector<Refusal>& cases) {
  expect_refused(cases, parse_provider_reply, "the provider (pid 2)");
}

// A shared prefill with one field replaced (or, for a null value, removed).
std::string shared_prefill_with(const std::string& key, const std::string& value) {
  nlohmann::ordered_json json = nlohmann::ordered_json::parse(vector_text("provider-prefill-shared-request-v1.json"));
  if (value == "null")
    json.erase(key);
  else
    json[key] = nlohmann::ordered_json::parse(value);
  return json.dump();
}

std::string file_prefill_with(const std::string& key, const std::string& value,
                              const char* vector = "provider-prefill-file-request-v1.json") {
  nlohmann::ordered_json json = nlohmann::ordered_json::parse(vector_text(vector));
  nlohmann::ordered_json* target = &json;
  std::string field = key;
  if (key.starts_with("kv.")) {
    target = &json["kv"];
    field = key.substr(3);
  }
  if (value == "null")
    target->erase(field);
  else
    (*target)[field] = nlohmann::ordered_json::parse(value);
  return json.dump();
}

TEST(ProviderProtocol, RefusesAnEnvelopeOfAnotherVersionOrOpNamingIt) {
  expect_request_refusals({
      {"", EINVAL, "not JSON"},
      {"{\"kvshare_provider\":1,", EINVAL, "not JSON"},
      {"[1]", EINVAL, "not a JSON object"},
      {R"({"op":"prefill"})", EINVAL, "no \"kvshare_provider\""},
      {R"({"kvshare_handshake":1,"type":"share"})", EINVAL, "not a kvshare resident provider message"},
      {R"({"kvshare_provider":"1","op":"prefill"})", EINVAL, "\"kvshare_provider\" is \"1\", not an unsigned integer"},
      {R"({"kvshare_provider":2,"op":"prefill"})", EPROTO, "protocol version 2, this side speaks 1"},
      {R"({"kvshare_provider":0,"op":"prefill"})", EPROTO, "protocol version 0"},
      {R"({"kvshare_provider":1})", EINVAL, "no \"op\""},
      {R"({"kvshare_provider":1,"op":7})", EINVAL, "\"op\" is 7, not a string"},
      {R"({"kvshare_provider":1,"op":"decode"})", EINVAL, "\"op\" is \"decode\", not one of hello, region, prefill"},
      {R"({"kvshare_provider":1,"op":"hello"})", EINVAL, "\"hello\" is the provider's word, not a request"},
  });
  expect_reply_refusals({
      {R"({"kvshare_provider":2,"op":"hello","ok":true})", EPROTO, "protocol version 2"},
      {R"({"kvshare_provider":1,"op":"adopt","ok":true})", EINVAL, "\"op\" is \"adopt\""},
  });
}

TEST(ProviderProtocol, RefusesAMalformedSharedPrefillNamingTheField) {
  expect_request_refusals({
      {shared_prefill_with("route", "null"), EINVAL, "no \"route\""},
      {shared_prefill_with("route", "\"remote\""), EINVAL, "\"route\" is \"remote\", not \"shared\" or \"file\""},
      {shared_prefill_with("route", "1"), EINVAL, "\"route\" is 1, not a string"},
      {shared_prefill_with("region_id", "null"), EINVAL, "no \"region_id\""},
      {shared_prefill_with("region_id", "0"), EINVAL, "\"region_id\" is 0, expected 1..2^53-1"},
      {shared_prefill_with("region_id", "9007199254740992"), EINVAL, "\"region_id\" is 9007199254740992"},
      {shared_prefill_with("region_id", "\"1\""), EINVAL, "\"region_id\" is \"1\", not an unsigned integer"},
      {shared_prefill_with("share_id", "null"), EINVAL, "no \"share_id\""},
      {shared_prefill_with("share_id", "0"), EINVAL, "\"share_id\" is 0"},
      {shared_prefill_with("n_cached", "null"), EINVAL, "no \"n_cached\""},
      {shared_prefill_with("n_cached", "-1"), EINVAL, "\"n_cached\" is -1, not an unsigned integer"},
      {shared_prefill_with("n_cached", "1.5"), EINVAL, "\"n_cached\" is 1.5, not an unsigned integer"},
      {shared_prefill_with("n_cached", "4294967296"), EINVAL, "\"n_cached\" is 4294967296, past 2^32-1"},
  });
}

TEST(ProviderProtocol, RefusesTokensThatAreNotAtLeastOneIdOfInt32) {
  expect_request_refusals({
      {shared_prefill_with("tokens", "null"), EINVAL, "no \"tokens\""},
      {shared_prefill_with("tokens", "[]"), EINVAL, "\"tokens\" is not an array of at least one id"},
      {shared_prefill_with("tokens", "\"1 2 3\""), EINVAL, "\"tokens\" is not an array of at least one id"},
      {shared_prefill_with("tokens", "{\"0\":1}"), EINVAL, "\"tokens\" is not an array of at least one id"},
      {shared_prefill_with("tokens", "[5,6,7,-1]"), EINVAL, "\"tokens[3]\" is -1, not a token id 0..2^31-1"},
      {shared_prefill_with("tokens", "[5,6,7,2147483648]"), EINVAL, "\"tokens[3]\" is 2147483648, not a token id"},
      {shared_prefill_with("tokens", "[5,6,7,1.0]"), EINVAL, "\"tokens[3]\" is 1.0, not a token id"},
      {shared_prefill_with("tokens", "[5,6,7,\"8\"]"), EINVAL, "\"tokens[3]\" is \"8\", not a token id"},
      {shared_prefill_with("tokens", "[5,6,7,null]"), EINVAL, "\"tokens[3]\" is null, not a token id"},
  });
}

TEST(ProviderProtocol, RefusesNCachedThatLeavesNoIdToPrefill) {
  // The vector caches 3 of its 6 ids.
  expect_request_refusals({
      {shared_prefill_with("n_cached", "6"), EINVAL, "\"n_cached\" is 6, expected below the 6 tokens"},
      {shared_prefill_with("n_cached", "7"), EINVAL, "\"n_cached\" is 7, expected below the 6 tokens"},
      {shared_prefill_with("tokens", "[5]"), EINVAL, "\"n_cached\" is 3, expected below the 1 tokens"},
  });
  ASSERT_TRUE(parse_provider_request(shared_prefill_with("n_cached", "5"), "test"));
}

TEST(ProviderProtocol, RefusesAMalformedFilePrefillNamingTheField) {
  expect_request_refusals({
      {file_prefill_with("state_file", "null"), EINVAL, "no \"state_file\""},
      {file_prefill_with("state_file", "\"kvshare-request-7.state\""), EINVAL,
       "\"state_file\" is \"kvshare-request-7.state\", not an absolute path"},
      {file_prefill_with("state_file", "\"./x.state\""), EINVAL,
       "\"state_file\" is \"./x.state\", not an absolute path"},
      {file_prefill_with("state_file", "\"\""), EINVAL, "\"state_file\" is \"\", not an absolute path"},
      {file_prefill_with("state_file", "\"/tmp/a\\u0000b\""), EINVAL, "not an absolute path"},
      {file_prefill_with("state_file", "[\"/tmp/x\"]"), EINVAL, "\"state_file\" is [\"/tmp/x\"], not a string"},
      {file_prefill_with("state_version", "null"), EINVAL, "no \"state_version\""},
      {file_prefill_with("state_version", "-3"), EINVAL, "\"state_version\" is -3, not an unsigned integer"},
      {file_prefill_with("kv", "null"), EINVAL, "\"kv\" is not an object"},
      {file_prefill_with("kv", "[4096]"), EINVAL, "\"kv\" is not an object"},
      {file_prefill_with("kv.n_ctx", "null"), EINVAL, "\"kv\": no \"n_ctx\""},
      {file_prefill_with("kv.n_ctx", "4294967296"), EINVAL, "\"kv\": \"n_ctx\" is 4294967296, past 2^32-1"},
      {file_prefill_with("kv.type_k", "8"), EINVAL, "\"kv\": \"type_k\" is 8, not a string"},
      {file_prefill_with("kv.type_v", "null"), EINVAL, "\"kv\": no \"type_v\""},
      {file_prefill_with("kv.flash_attn", "\"on\""), EINVAL, "\"kv\": \"flash_attn\" is \"on\", not true or false"},
      {file_prefill_with("tokens", "[]"), EINVAL, "\"tokens\" is not an array of at least one id"},
  });
}

// Issue #27: a decoder of 4 slots, one stream each; the provider's state file carries 4.
TEST(ProviderProtocol, DecodesTheFilePrefillForFourSlotsVectorAndReencodesItToTheSameBytes) {
  const std::string text = vector_text("provider-prefill-file-slots-request-v1.json");
  auto request = parse_provider_request(text, "vector");
  ASSERT_TRUE(request) << request.error().what();
  EXPECT_EQ(request->route, PrefillRoute::file);
  EXPECT_EQ(request->kv, (ProviderKvParams{2048, "f16", "f16", true, 4, false}));
  EXPECT_EQ(encode_provider_request(*request), text);
  // One slot: neither field is written, and the older vector reads as one unified stream.
  request->kv.n_seq_max = 1;
  request->kv.kv_unified = true;
  EXPECT_EQ(encode_provider_request(*request).find("n_seq_max"), std::string::npos);
  auto older = parse_provider_request(vector_text("provider-prefill-file-request-v1.json"), "vector");
  ASSERT_TRUE(older) << older.error().what();
  EXPECT_EQ(older->kv.n_seq_max, 1u);
  EXPECT_TRUE(older->kv.kv_unified);
  // Several slots, unified (-kvu): one stream of every slot's cells.
  auto unified = parse_provider_request(
      file_prefill_with("kv.kv_unified", "true", "provider-prefill-file-slots-request-v1.json"), "vector");
  ASSERT_TRUE(unified) << unified.error().what();
  EXPECT_EQ(unified->kv.n_seq_max, 4u);
  EXPECT_TRUE(unified->kv.kv_unified);
}

TEST(ProviderProtocol, RefusesSlotCountsThatAreNotOneOrMoreNamingTheField) {
  const char* slots = "provider-prefill-file-slots-request-v1.json";
  expect_request_refusals({
      {file_prefill_with("kv.n_seq_max", "0", slots), EINVAL, "\"n_seq_max\" is 0, expected the decoder's slots"},
      {file_prefill_with("kv.n_seq_max", "-2", slots), EINVAL, "\"n_seq_max\""},
      {file_prefill_with("kv.n_seq_max", "\"4\"", slots), EINVAL, "\"n_seq_max\""},
      {file_prefill_with("kv.kv_unified", "1", slots), EINVAL, "\"kv_unified\""},
  });
}

TEST(ProviderProtocol, RefusesAMalformedRegionRequestNamingTheField) {
  const std::string share = handshake_share_json();
  expect_request_refusals({
      {R"({"kvshare_provider":1,"op":"region","share":)" + share + "}", EINVAL, "no \"region_id\""},
      {R"({"kvshare_provider":1,"op":"region","region_id":0,"share":)" + share + "}", EINVAL, "\"region_id\" is 0"},
      {R"({"kvshare_provider":1,"op":"region","region_id":1})", EINVAL,
       "\"share\" is not the decoder's share message (an object)"},
      {R"({"kvshare_provider":1,"op":"region","region_id":1,"share":"x"})", EINVAL,
       "\"share\" is not the decoder's share message"},
  });
}

TEST(ProviderProtocol, RefusesARegionWhoseShareIsARefusal) {
  ProviderRequest request{.op = ProviderOp::region, .region_id = 4};
  request.share =
      handshake::make_refusal(7, "params.type_k", "field \"params.type_k\" is \"q8_0\", this decoder uses \"f16\"");
  auto parsed = parse_provider_request(encode_provider_request(request), "kvshare-serve (pid 1)");
  ASSERT_FALSE(parsed);
  EXPECT_EQ(parsed.error().errno_value(), EINVAL);
  EXPECT_NE(parsed.error().message().find("kvshare-serve (pid 1): \"share\" is a refusal, not a share"),
            std::string::npos)
      << parsed.error().what();
}

// The share's own errors are the handshake's (docs/protocol.md), naming the region
// request's "share" as their source and the handshake field.
TEST(ProviderProtocol, SurfacesTheHandshakeErrorOfAMalformedShare) {
  auto region_with_share = [](const std::string& key, const std::string& value) {
    nlohmann::ordered_json json = nlohmann::ordered_json::parse(vector_text("provider-region-request-v1.json"));
    auto& share = json["share"];
    if (key == "fds[0].kind")
      share["fds"][0]["kind"] = value;
    else if (value == "null")
      share.erase(key);
    else
      share[key] = nlohmann::ordered_json::parse(value);
    return json.dump();
  };
  expect_request_refusals({
      {region_with_share("kvshare_handshake", "2"), EPROTO,
       "handshake from kvshare-serve (pid 1) \"share\": field \"kvshare_handshake\" is 2"},
      {region_with_share("kvshare_handshake", "null"), EINVAL, "not a kvshare handshake message"},
      {region_with_share("share_id", "0"), EINVAL, "field \"share_id\" is 0"},
      {region_with_share("fds", "[]"), EINVAL, "field \"fds\" must be an array of 1..253 entries"},
      {region_with_share("fds[0].kind", "pipe"), EINVAL, "field \"fds[0].kind\" is \"pipe\""},
      {region_with_share("header", "null"), EINVAL, "\"header\""},
      {region_with_share("header", "[1]"), EINVAL, "field \"header\" is array, expected the layout header object"},
  });
}

TEST(ProviderProtocol, RefusesAMalformedReplyNamingTheField) {
  expect_reply_refusals({
      {R"({"kvshare_provider":1,"op":"prefill","prefill_ms":1,"n_prefilled":1})", EINVAL, "no \"ok\""},
      {R"({"kvshare_provider":1,"op":"prefill","ok":1,"prefill_ms":1,"n_prefilled":1})", EINVAL,
       "\"ok\" is 1, not true or false"},
      {R"({"kvshare_provider":1,"op":"hello","ok":true,"routes":["shared"],"cached":true})", EINVAL, "no \"pid\""},
      {R"({"kvshare_provider":1,"op":"hello","ok":true,"pid":-4,"routes":["shared"],"cached":true})", EINVAL,
       "\"pid\" is -4, not an unsigned integer"},
      {R"({"kvshare_provider":1,"op":"hello","ok":true,"pid":4,"cached":true})", EINVAL,
       "\"routes\" is not an array of route names"},
      {R"({"kvshare_provider":1,"op":"hello","ok":true,"pid":4,"routes":"shared","cached":true})", EINVAL,
       "\"routes\" is not an array of route names"},
      {R"({"kvshare_provider":1,"op":"hello","ok":true,"pid":4,"routes":[],"cached":true})", EINVAL,
       "\"routes\" names no route"},
      {R"({"kvshare_provider":1,"op":"hello","ok":true,"pid":4,"routes":["shared","remote"],"cached":true})", EINVAL,
       "\"routes\" holds \"remote\", not \"shared\" or \"file\""},
      {R"({"kvshare_provider":1,"op":"hello","ok":true,"pid":4,"routes":[1],"cached":true})", EINVAL,
       "\"routes\" holds 1"},
      {R"({"kvshare_provider":1,"op":"hello","ok":true,"pid":4,"routes":["file"]})", EINVAL, "no \"cached\""},
      {R"({"kvshare_provider":1,"op":"region","ok":true,"region_ms":1})", EINVAL, "no \"region_id\""},
      {R"({"kvshare_provider":1,"op":"region","ok":true,"region_id":0,"region_ms":1})", EINVAL,
       "\"region_id\" is 0, expected 1..2^53-1"},
      {R"({"kvshare_provider":1,"op":"region","ok":true,"region_id":1,"region_ms":"1"})", EINVAL,
       "\"region_ms\" is \"1\", not a number"},
      {R"({"kvshare_provider":1,"op":"region","ok":true,"region_id":1})", EINVAL, "no \"region_ms\""},
      {R"({"kvshare_provider":1,"op":"prefill","ok":true,"n_prefilled":1})", EINVAL, "no \"prefill_ms\""},
      {R"({"kvshare_provider":1,"op":"prefill","ok":true,"prefill_ms":1,"n_prefilled":-1})", EINVAL,
       "\"n_prefilled\" is -1, not an unsigned integer"},
  });
}

TEST(ProviderProtocol, RefusesARefusalWithoutAnErrnoValueOrSentence) {
  expect_reply_refusals({
      {R"({"kvshare_provider":1,"op":"prefill","ok":false,"errno":0,"error":"x"})", EINVAL,
       "\"errno\" is 0, not an errno value 1..4095"},
      {R"({"kvshare_provider":1,"op":"prefill","ok":false,"errno":4096,"error":"x"})", EINVAL,
       "\"errno\" is 4096, not an errno value 1..4095"},
      {R"({"kvshare_provider":1,"op":"prefill","ok":false,"errno":-116,"error":"x"})", EINVAL,
       "\"errno\" is -116, not an unsigned integer"},
      {R"({"kvshare_provider":1,"op":"prefill","ok":false,"error":"x"})", EINVAL, "no \"errno\""},
      {R"({"kvshare_provider":1,"op":"region","ok":false,"errno":116})", EINVAL, "no \"error\""},
      {R"({"kvshare_provider":1,"op":"region","ok":false,"errno":116,"error":null})", EINVAL,
       "\"error\" is null, not a string"},
  });
}

TEST(ProviderProtocol, RefusesAnOversizedMessageBeforeParsing) {
  const std::string big(kMaxProviderMessageBytes + 1, ' ');
  auto request = parse_provider_request(big, "peer");
  auto reply = parse_provider_reply(big, "peer");
  ASSERT_FALSE(request);
  ASSERT_FALSE(reply);
  for (const Error& error : {request.error(), reply.error()}) {
    EXPECT_EQ(error.errno_value(), EMSGSIZE);
    EXPECT_NE(error.message().find("peer: 16777217 bytes, the limit is 16777216"), std::string::npos) << error.what();
  }
  // At the limit it is parsed (and refused for what it says, not for its size).
  std::string at_limit = R"({"kvshare_provider":1,"op":"decode"})";
  at_limit.append(kMaxProviderMessageBytes - at_limit.size(), ' ');
  auto parsed = parse_provider_request(at_limit, "peer");
  ASSERT_FALSE(parsed);
  EXPECT_NE(parsed.error().message().find("\"op\" is \"decode\""), std::string::npos) << parsed.error().what();
}

TEST(ProviderProtocol, RefusesDeepNestingBeforeParsing) {
  const std::string deep =
      R"({"kvshare_provider":1,"op":"prefill","x":)" + std::string(100, '[') + std::string(100, ']') + "}";
  auto request = parse_provider_request(deep, "peer");
  auto reply = parse_provider_reply(deep, "peer");
  ASSERT_FALSE(request);
  ASSERT_FALSE(reply);
  for (const Error& error : {request.error(), reply.error()}) {
    EXPECT_EQ(error.errno_value(), EINVAL);
    EXPECT_NE(error.message().find("nests deeper than 32 levels"), std::string::npos) << error.what();
  }
  // A header nested past the bound inside a region's share is refused the same way.
  const std::string deep_share = R"({"kvshare_provider":1,"op":"region","region_id":1,"share":{"header":)" +
                                 std::string(40, '[') + std::string(40, ']') + "}}";
  auto parsed = parse_provider_request(deep_share, "peer");
  ASSERT_FALSE(parsed);
  EXPECT_NE(parsed.error().message().find("nests deeper"), std::string::npos) << parsed.error().what();
}

// What a provider answers itself, before its engine sees a prefill: the region held and the
// routes its hello offered (the C API's kvshare_resident_next answers with it).
TEST(ProviderProtocol, AdmitsAPrefillOnlyForTheRegionHeldAndTheRoutesOffered) {
  ProviderReply hello;
  hello.op = ProviderOp::hello;
  hello.takes_file = false;
  hello.takes_cached = false;
  ProviderRequest prefill;
  prefill.route = PrefillRoute::shared;
  prefill.region_id = 2;
  EXPECT_TRUE(check_prefill_admitted(hello, 2, prefill));

  auto none_held = check_prefill_admitted(hello, 0, prefill);
  ASSERT_FALSE(none_held);
  EXPECT_EQ(none_held.error().errno_value(), ESTALE);
  EXPECT_EQ(none_held.error().message(), "region 2: this provider holds no region; send it");
  auto other = check_prefill_admitted(hello, 3, prefill);
  ASSERT_FALSE(other);
  EXPECT_EQ(other.error().errno_value(), ESTALE);
  EXPECT_EQ(other.error().message(), "region 2: this provider holds region 3; send region 2 again");

  prefill.n_cached = 1;
  auto cached = check_prefill_admitted(hello, 2, prefill);
  ASSERT_FALSE(cached);
  EXPECT_EQ(cached.error().errno_value(), ENOTSUP);
  EXPECT_NE(cached.error().message().find("n_cached 1: this provider prefills whole prompts only"), std::string::npos);

  ProviderRequest file;
  file.route = PrefillRoute::file;
  auto route = check_prefill_admitted(hello, 2, file);
  ASSERT_FALSE(route);
  EXPECT_EQ(route.error().errno_value(), ENOTSUP);
  EXPECT_EQ(route.error().message(), "this provider does not take the file route (its hello offered shared)");
}

}  // namespace
}  // namespace kvshare
