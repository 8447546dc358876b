// Slot actions follow llama-server's --api-key: with a key set, a request without it gets
// llama-server's 401 body and never reaches the engine; share (which hands out the KV
// memory) is as guarded as restore. Bug pinned: kvshare-decoder had no --api-key, so any
// process that reached its port could ask it to share its KV cache with any socket.
#include <gmock/gmock.h>

#include <memory>
#include <thread>

#include "apps/decoder/fake_engine.h"
#include "apps/decoder/http_server.h"
#include "route/api_key.h"
#include "route/decoder_client.h"
#include "route/upstream_stream.h"
#include "support/test_support.h"

namespace kvshare::security {
namespace {

using route::DecoderClient;
using route::HttpReply;
using Json = nlohmann::json;
using decoder::ShareAvailability;
using ::testing::HasSubstr;

constexpr const char* kKey = "s3cret-key";

class KeyedDecoder {
 public:
  explicit KeyedDecoder(std::vector<std::string> keys) : engine_(64, ShareAvailability::enabled) {
    decoder::ServerOptions options;
    options.port = 0;
    options.model_name = "fake.gguf";
    options.slot_save_path = dir_.path();
    options.api_keys = std::move(keys);
    server_ = std::make_unique<decoder::DecoderServer>(options);
    EXPECT_TRUE(server_->bind());
    server_->attach(engine_);
    thread_ = std::thread([this] { (void)server_->listen(); });
    EXPECT_TRUE(::kvshare::testing::wait_until([&] {
      auto r = client().get("/health");
      return r && r->status == 200;
    })) << "the in-process decoder never answered /health";
  }
  ~KeyedDecoder() {
    server_->stop();
    thread_.join();
  }
  int port() const { return server_->bound_port(); }
  DecoderClient client() const { return DecoderClient("127.0.0.1", port(), std::chrono::seconds(120)); }
  decoder::testing::FakeEngine& engine() { return engine_; }

 private:
  ::kvshare::testing::TempDir dir_;
  decoder::testing::FakeEngine engine_;
  std::unique_ptr<decoder::DecoderServer> server_;
  std::thread thread_;
};

void expect_401(const Result<HttpReply>& reply) {
  ASSERT_TRUE(reply) << reply.error().what();
  EXPECT_EQ(reply->status, 401);
  EXPECT_EQ(reply->body, route::kInvalidApiKeyBody);
  EXPECT_THAT(reply->content_type, HasSubstr("application/json"));
}

TEST(DecoderApiKey, RefusesShareWithoutTheKeyAndNeverAsksTheEngine) {
  KeyedDecoder decoder({kKey});
  expect_401(decoder.client().post_json("/slots/0?action=share", Json{{"socket", "/tmp/x/share.sock"}}));
  DecoderClient keyed = decoder.client();
  keyed.set_header("Authorization", std::string("Bearer ") + kKey);
  auto shared = keyed.post_json("/slots/0?action=share", Json{{"socket", "/tmp/x/share.sock"}});
  ASSERT_TRUE(shared);
  ASSERT_EQ(shared->status, 200) << shared->body;
  EXPECT_EQ(shared->json()["share_id"], 1);  // the refused request made no share
}

TEST(DecoderApiKey, RefusesAWrongKeyOnEverySlotAction) {
  KeyedDecoder decoder({kKey});
  DecoderClient wrong = decoder.client();
  wrong.set_header("Authorization", "Bearer not-the-key");
  expect_401(wrong.post_json("/slots/0?action=share", Json{{"socket", "/tmp/x/share.sock"}}));
  expect_401(wrong.post_json("/slots/0?action=adopt", Json{{"tokens", {1}}, {"share_id", 1}}));
  expect_401(wrong.post_json("/slots/0?action=save", Json{{"filename", "a.bin"}}));
  expect_401(wrong.post_json("/slots/0?action=restore", Json{{"filename", "a.bin"}}));
  expect_401(wrong.post_json("/slots/0?action=erase", Json::object()));
  expect_401(wrong.get("/slots"));
  expect_401(wrong.post_json("/completion", Json{{"prompt", "hi"}}));
}

TEST(DecoderApiKey, RefusesAKeyThatIsAPrefixOfTheRealOne) {
  KeyedDecoder decoder({kKey});
  DecoderClient prefix = decoder.client();
  prefix.set_header("Authorization", "Bearer s3cret");
  expect_401(prefix.post_json("/slots/0?action=erase", Json::object()));
}

TEST(DecoderApiKey, KeepsHealthOpen) {
  KeyedDecoder decoder({kKey});
  auto health = decoder.client().get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  auto v1 = decoder.client().get("/v1/health");
  ASSERT_TRUE(v1);
  EXPECT_EQ(v1->status, 200);
}

TEST(DecoderApiKey, TakesTheKeyWithoutBearerOrAsXApiKeyLikeLlamaServer) {
  KeyedDecoder decoder({"first", kKey});
  DecoderClient bare = decoder.client();
  bare.set_header("Authorization", kKey);
  auto erased = bare.post_json("/slots/0?action=erase", Json::object());
  ASSERT_TRUE(erased);
  EXPECT_EQ(erased->status, 200) << erased->body;
  DecoderClient anthropic = decoder.client();
  anthropic.set_header("X-Api-Key", kKey);
  auto erased_again = anthropic.post_json("/slots/0?action=erase", Json::object());
  ASSERT_TRUE(erased_again);
  EXPECT_EQ(erased_again->status, 200) << erased_again->body;
}

TEST(DecoderApiKey, AnswersEverythingWithoutAKeyWhenNoneIsSet) {
  KeyedDecoder decoder({});
  auto erased = decoder.client().post_json("/slots/0?action=erase", Json::object());
  ASSERT_TRUE(erased);
  EXPECT_EQ(erased->status, 200);
}

TEST(ServeForwardsApiKey, SendsItsKeyWithEverySlotAction) {
  KeyedDecoder decoder({kKey});
  const route::DecoderClient keyless("127.0.0.1", decoder.port(), std::chrono::milliseconds(5000));
  auto refused = keyless.slot_action("erase", nlohmann::json::object());
  ASSERT_TRUE(refused);
  EXPECT_EQ(refused->status, 401);
  EXPECT_EQ(refused->error_message, "Invalid API Key");
  const route::DecoderClient keyed("127.0.0.1", decoder.port(), std::chrono::milliseconds(5000), kKey);
  auto erased = keyed.slot_action("erase", nlohmann::json::object());
  ASSERT_TRUE(erased);
  EXPECT_EQ(erased->status, 200) << erased->error_message;
}

TEST(ServeForwardsApiKey, SendsItsKeyWithAForwardedRequest) {
  KeyedDecoder decoder({kKey});
  route::UpstreamStream::Request request;
  request.host = "127.0.0.1";
  request.port = decoder.port();
  request.method = "GET";
  request.path = "/slots";
  request.api_key = kKey;
  auto stream = route::UpstreamStream::start(request, [] {});
  auto head = stream->wait_head();
  ASSERT_TRUE(head) << head.error().what();
  EXPECT_EQ(head->status, 200);
  request.api_key.clear();
  auto keyless = route::UpstreamStream::start(request, [] {});
  auto refused = keyless->wait_head();
  ASSERT_TRUE(refused) << refused.error().what();
  EXPECT_EQ(refused->status, 401);
}

TEST(ApiKeyList, SplitsCommasAndDropsEmptyEntriesAsLlamaServer) {
  EXPECT_EQ(route::parse_api_key_list("a,,b,"), (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(route::parse_api_key_list("").empty());
}

TEST(ApiKeyList, ReadsAKeyFileSkippingCommentsAndNamesAMissingOne) {
  ::kvshare::testing::TempDir dir;
  const std::string text = "# keys\nk1\n\nk2\n";
  ::kvshare::testing::write_file_bytes(
      dir / "keys", std::vector<std::byte>(reinterpret_cast<const std::byte*>(text.data()),
                                           reinterpret_cast<const std::byte*>(text.data()) + text.size()));
  auto keys = route::read_api_key_file(dir / "keys");
  ASSERT_TRUE(keys);
  EXPECT_EQ(*keys, (std::vector<std::string>{"k1", "k2"}));
  auto missing = route::read_api_key_file(dir / "nope");
  ASSERT_FALSE(missing);
  EXPECT_THAT(missing.error().message(), HasSubstr("--api-key-file"));
}

}  // namespace
}  // namespace kvshare::security
