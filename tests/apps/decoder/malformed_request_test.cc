// Bad bodies on every route of an in-process decoder (fake engine): each gets a JSON
// error or a normal reply, never a crash, a hang or a non-JSON 500; the server keeps
// answering afterwards. Deterministic, so failures reproduce.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <thread>

#include "apps/decoder/http_server.h"
#include "fake_engine.h"
#include "route/decoder_client.h"
#include "route/sse_events.h"
#include "support/test_support.h"

namespace kvshare::decoder {
namespace {

class InProcessDecoder {
 public:
  InProcessDecoder() : engine_(32, ShareAvailability::enabled) {
    ServerOptions options;
    options.port = 0;
    options.model_name = "fake.gguf";
    options.slot_save_path = dir_.path();
    server_ = std::make_unique<DecoderServer>(options);
    EXPECT_TRUE(server_->bind());
    server_->attach(engine_);
    thread_ = std::thread([this] { (void)server_->listen(); });
    client_ = std::make_unique<route::DecoderClient>("127.0.0.1", server_->bound_port(), std::chrono::seconds(20));
    EXPECT_TRUE(::kvshare::testing::wait_until([&] {
      auto r = client_->get("/health");
      return r && r->status == 200;
    })) << "the in-process decoder never answered /health";
  }
  ~InProcessDecoder() {
    server_->stop();
    thread_.join();
  }
  const route::DecoderClient& client() const { return *client_; }

 private:
  ::kvshare::testing::TempDir dir_;
  testing::FakeEngine engine_;
  std::unique_ptr<DecoderServer> server_;
  std::thread thread_;
  std::unique_ptr<route::DecoderClient> client_;
};

const char* const kRoutes[] = {
    "/completion",
    "/v1/completions",
    "/v1/chat/completions",
    "/tokenize",
    "/detokenize",
    "/apply-template",
    "/slots/0?action=save",
    "/slots/0?action=restore",
    "/slots/0?action=erase",
    "/slots/0?action=share",
    "/slots/0?action=adopt",
    "/slots/0?action=",
    "/props",
};

const char* const kBodies[] = {
    "",
    "{",
    "}",
    "null",
    "[]",
    "0",
    "\"x\"",
    "{\"prompt\": null}",
    "{\"prompt\": {}}",
    "{\"prompt\": [[1]]}",
    "{\"prompt\": [1.5]}",
    "{\"prompt\": [-1]}",
    "{\"prompt\": true}",
    "{\"prompt\": \"x\", \"stop\": 3}",
    "{\"prompt\": \"x\", \"stream\": \"yes\"}",
    "{\"prompt\": \"x\", \"n_predict\": 1e30}",
    "{\"prompt\": \"x\", \"temperature\": -5, \"n_predict\": 2}",
    "{\"prompt\": \"x\", \"seed\": -1, \"n_predict\": 1}",
    "{\"prompt\": \"x\", \"temperature\": 1e300, \"n_predict\": 1}",
    "{\"prompt\": \"x\", \"seed\": -1e30}",
    "{\"prompt\": \"x\", \"n_keep\": -1e300}",
    "{\"prompt\": \"x\", \"n_predict\": 2.5}",
    "{\"prompt\": \"x\", \"stream_options\": 7, \"stream\": true, \"n_predict\": 1}",
    "{\"messages\": [{\"role\": 1, \"content\": 2}]}",
    "{\"messages\": [null]}",
    "{\"messages\": [{\"content\": [1]}]}",
    "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\"}]}]}",
    "{\"content\": {}}",
    "{\"content\": [\"a\", {}]}",
    "{\"tokens\": \"abc\"}",
    "{\"tokens\": [99999]}",
    "{\"filename\": 5}",
    "{\"filename\": \"\"}",
    "{\"filename\": \"a\\u0000b\"}",
    "{\"socket\": 5}",
    "{\"socket\": \"/nonexistent/dir/sock\"}",
    "{\"tokens\": [1, \"a\"], \"share_id\": 1}",
    "{\"tokens\": [1], \"share_id\": -1}",
    "{\"tokens\": null, \"share_id\": null}",
    "{\"transport\": \"ucx\"}",
    "{\"transport\": \"ucx\", \"n_tokens\": 0}",
    "{\"transport\": 7, \"n_tokens\": 1}",
    "{\"transport\": \"ucx\", \"n_tokens\": 3}",
    "{\"transport\": \"ucx\", \"n_tokens\": 1e30}",
};

TEST(DecoderMalformedRequests, AnswerEveryBadBodyOnEveryRouteWithJsonAndKeepServing) {
  InProcessDecoder decoder;
  for (const char* route : kRoutes) {
    for (const char* body : kBodies) {
      auto reply = decoder.client().post_json(route, std::string(body));
      ASSERT_TRUE(reply) << route << " " << body << ": " << reply.error().what();
      EXPECT_LT(reply->status, 600);
      if (reply->content_type.find("text/event-stream") != std::string::npos) {
        auto events = route::parse_sse_events(reply->body);
        EXPECT_TRUE(events) << route << " " << body << ": " << events.error().what();
        continue;
      }
      const auto parsed = reply->json();
      ASSERT_FALSE(parsed.is_discarded()) << route << " " << body << " -> " << reply->status << " " << reply->body;
      if (reply->status >= 400) {
        EXPECT_EQ(parsed["error"]["code"], reply->status) << route << " " << body;
      }
    }
  }
  auto health = decoder.client().get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

TEST(DecoderMalformedRequests, SurvivesRandomBytesAsBodies) {
  InProcessDecoder decoder;
  std::mt19937 rng(1234);
  for (int i = 0; i < 150; ++i) {
    std::string body(rng() % 64, '\0');
    for (auto& c : body) c = static_cast<char>(rng() % 256);
    if (i % 3 == 0) body = "{\"prompt\": " + body + "}";
    auto reply = decoder.client().post_json(kRoutes[i % std::size(kRoutes)], body);
    ASSERT_TRUE(reply) << reply.error().what();
    EXPECT_LT(reply->status, 600);
  }
  auto health = decoder.client().get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

}  // namespace
}  // namespace kvshare::decoder
