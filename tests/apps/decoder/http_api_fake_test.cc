// The decoder's HTTP API against an in-process server over FakeEngine: status codes,
// error bodies, SSE framing, the prompt-cache rule and the slot actions, without a model.
#include <gtest/gtest.h>

#include <fstream>
#include <memory>
#include <thread>

#include "apps/decoder/http_server.h"
#include "fake_engine.h"
#include "route/decoder_client.h"
#include "route/sse_events.h"
#include "support/test_support.h"

namespace kvshare::decoder {
namespace {

using Json = nlohmann::json;
using route::HttpReply;
using route::parse_sse_events;
using testing::FakeEngine;

class FakeServer {
 public:
  explicit FakeServer(ShareAvailability share = ShareAvailability::flag_not_set, bool with_slot_path = true,
                      int32_t n_ctx = 64)
      : engine_(n_ctx, share) {
    ServerOptions options;
    options.host = "127.0.0.1";
    options.port = 0;
    options.model_name = "fake.gguf";
    if (with_slot_path) options.slot_save_path = dir_.path();
    server_ = std::make_unique<DecoderServer>(options);
    auto bound = server_->bind();
    EXPECT_TRUE(bound) << bound.error().what();
    server_->attach(engine_);
    thread_ = std::thread([this] { (void)server_->listen(); });
    client_ = std::make_unique<route::DecoderClient>("127.0.0.1", server_->bound_port(), std::chrono::seconds(120));
    EXPECT_TRUE(::kvshare::testing::wait_until([&] {
      auto r = client_->get("/health");
      return r && r->status == 200;
    })) << "the in-process decoder never answered /health";
  }
  ~FakeServer() {
    server_->stop();
    thread_.join();
  }
  FakeEngine& engine() { return engine_; }
  const route::DecoderClient& client() const { return *client_; }
  const ::kvshare::testing::TempDir& dir() const { return dir_; }

  HttpReply post(const std::string& path, const Json& body) const {
    auto r = client_->post_json(path, body);
    EXPECT_TRUE(r) << r.error().what();
    return r ? *r : HttpReply{};
  }
  HttpReply post_raw(const std::string& path, const std::string& body) const {
    auto r = client_->post_json(path, body);
    EXPECT_TRUE(r) << r.error().what();
    return r ? *r : HttpReply{};
  }
  HttpReply get(const std::string& path) const {
    auto r = client_->get(path);
    EXPECT_TRUE(r) << r.error().what();
    return r ? *r : HttpReply{};
  }

 private:
  ::kvshare::testing::TempDir dir_;
  FakeEngine engine_;
  std::unique_ptr<DecoderServer> server_;
  std::thread thread_;
  std::unique_ptr<route::DecoderClient> client_;
};

// The greedy continuation FakeEngine gives for `prompt`, computed independently.
std::vector<int32_t> expected_continuation(std::vector<int32_t> context, int n) {
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    const int32_t next = FakeEngine::next_token(context);
    out.push_back(next);
    if (next == FakeEngine::kEos || next == FakeEngine::kImEnd) break;
    context.push_back(next);
  }
  return out;
}

void expect_error(const HttpReply& reply, int status, const std::string& type, const std::string& words) {
  EXPECT_EQ(reply.status, status) << reply.body;
  EXPECT_NE(reply.content_type.find("application/json"), std::string::npos);
  const Json body = Json::parse(reply.body);
  ASSERT_TRUE(body.contains("error")) << reply.body;
  EXPECT_EQ(body["error"]["code"], status);
  EXPECT_EQ(body["error"]["type"], type);
  EXPECT_NE(body["error"]["message"].get<std::string>().find(words), std::string::npos) << reply.body;
}

const std::vector<int32_t> kPrompt = {FakeEngine::kBos, 'h', 'e', 'l', 'l', 'o', ' ', 'w'};

TEST(DecoderHttpFake, AnswersHealthAndPropsLikeLlamaServer) {
  FakeServer server;
  EXPECT_EQ(server.get("/health").json(), Json({{"status", "ok"}}));
  EXPECT_EQ(server.get("/v1/health").status, 200);
  const Json props = server.get("/props").json();
  EXPECT_EQ(props["total_slots"], 1);
  EXPECT_EQ(props["default_generation_settings"]["n_ctx"], 64);
  EXPECT_EQ(props["model_path"], "fake.gguf");
  const Json models = server.get("/v1/models").json();
  EXPECT_EQ(models["data"][0]["id"], "fake.gguf");
}

TEST(DecoderHttpFake, AnswersAnUnknownPathWith404FileNotFound) {
  FakeServer server;
  expect_error(server.get("/nope"), 404, "not_found_error", "File Not Found");
  expect_error(server.get("/slots/0"), 404, "not_found_error", "File Not Found");
}

TEST(DecoderHttpFake, TokenizesWithLlamaServerDefaults) {
  FakeServer server;
  EXPECT_EQ(server.post("/tokenize", {{"content", "hi"}}).json()["tokens"], Json({'h', 'i'}));
  EXPECT_EQ(server.post("/tokenize", {{"content", "hi"}, {"add_special", true}}).json()["tokens"],
            Json({FakeEngine::kBos, 'h', 'i'}));
  EXPECT_EQ(server.post("/tokenize", {{"content", "<s>"}, {"parse_special", false}}).json()["tokens"],
            Json({'<', 's', '>'}));
  const Json pieces = server.post("/tokenize", {{"content", "a</s>"}, {"with_pieces", true}}).json();
  EXPECT_EQ(pieces["tokens"][1], Json({{"id", FakeEngine::kEos}, {"piece", "</s>"}}));
  EXPECT_EQ(server.post("/tokenize", Json::object()).json(), Json({{"tokens", Json::array()}}));
  EXPECT_EQ(server.post("/detokenize", {{"tokens", {FakeEngine::kBos, 'o', 'k'}}}).json()["content"], "<s>ok");
}

TEST(DecoderHttpFake, AppliesTheChatTemplateWithoutALeadingBos) {
  FakeServer server;
  const Json reply = server.post("/apply-template", {{"messages", {{{"role", "user"}, {"content", "hi"}}}}}).json();
  EXPECT_EQ(reply["prompt"], "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
  expect_error(server.post("/apply-template", Json::object()), 400, "invalid_request_error", "'messages' is required");
}

TEST(DecoderHttpFake, CompletesGreedilyAndReportsTimingsAndCacheCounts) {
  FakeServer server;
  const Json reply =
      server.post("/completion", {{"prompt", kPrompt}, {"n_predict", 4}, {"temperature", 0}, {"return_tokens", true}})
          .json();
  const auto expected = expected_continuation(kPrompt, 4);
  EXPECT_EQ(reply["tokens"], Json(expected));
  EXPECT_EQ(reply["tokens_evaluated"], static_cast<int>(kPrompt.size()));
  EXPECT_EQ(reply["tokens_predicted"], static_cast<int>(expected.size()));
  EXPECT_EQ(reply["timings"]["prompt_n"], static_cast<int>(kPrompt.size()));
  EXPECT_EQ(reply["timings"]["cache_n"], 0);
  EXPECT_EQ(reply["id_slot"], 0);
  // The last sampled token is never decoded: the slot holds the prompt and n-1 tokens.
  EXPECT_EQ(reply["tokens_cached"], static_cast<int>(kPrompt.size() + expected.size() - 1));
}

TEST(DecoderHttpFake, SamplesOneTokenWhenNPredictIsZeroAndKeepsOnlyThePrompt) {
  FakeServer server;
  const Json reply = server.post("/completion", {{"prompt", kPrompt}, {"n_predict", 0}, {"temperature", 0}}).json();
  EXPECT_EQ(reply["tokens_predicted"], 1);
  EXPECT_EQ(reply["stop_type"], "limit");
  EXPECT_EQ(reply["tokens_cached"], static_cast<int>(kPrompt.size()));
}

TEST(DecoderHttpFake, ReevaluatesOnlyTheLastTokenOfARepeatedPrompt) {
  FakeServer server;
  server.post("/completion", {{"prompt", kPrompt}, {"n_predict", 0}, {"temperature", 0}});
  const int64_t before = server.engine().n_evaluated();
  const Json reply =
      server.post("/completion", {{"prompt", kPrompt}, {"n_predict", 0}, {"temperature", 0}, {"id_slot", 0}}).json();
  EXPECT_EQ(reply["timings"]["prompt_n"], 1);
  EXPECT_EQ(reply["timings"]["cache_n"], static_cast<int>(kPrompt.size()) - 1);
  EXPECT_EQ(server.engine().n_evaluated() - before, 1);
  const Json off = server.post("/completion", {{"prompt", kPrompt}, {"n_predict", 0}, {"cache_prompt", false}}).json();
  EXPECT_EQ(off["timings"]["prompt_n"], static_cast<int>(kPrompt.size()));
}

TEST(DecoderHttpFake, DecodesARestoredPromptMinusOneWithOneEvaluatedToken) {
  FakeServer server;
  const Json own =
      server.post("/completion", {{"prompt", kPrompt}, {"n_predict", 6}, {"temperature", 0}, {"return_tokens", true}})
          .json();
  // Fill the slot with the prompt less its last token, save it, wipe the slot.
  const std::vector<int32_t> head(kPrompt.begin(), kPrompt.end() - 1);
  server.post("/completion", {{"prompt", head}, {"n_predict", 0}, {"cache_prompt", false}});
  const Json saved = server.post("/slots/0?action=save", {{"filename", "head.bin"}}).json();
  EXPECT_EQ(saved["n_saved"], static_cast<int>(head.size()));
  EXPECT_GT(saved["n_written"].get<int>(), 0);
  EXPECT_TRUE(saved["timings"].contains("save_ms"));
  EXPECT_EQ(server.post("/slots/0?action=erase", Json::object()).json()["n_erased"], static_cast<int>(head.size()));

  const Json restored = server.post("/slots/0?action=restore", {{"filename", "head.bin"}}).json();
  EXPECT_EQ(restored["n_restored"], static_cast<int>(head.size()));
  EXPECT_EQ(restored["n_read"], saved["n_written"]);
  EXPECT_TRUE(restored["timings"].contains("restore_ms"));
  const Json reply =
      server
          .post("/completion",
                {{"prompt", kPrompt}, {"n_predict", 6}, {"temperature", 0}, {"id_slot", 0}, {"return_tokens", true}})
          .json();
  EXPECT_EQ(reply["tokens"], own["tokens"]);
  EXPECT_EQ(reply["timings"]["prompt_n"], 1);
  EXPECT_EQ(reply["timings"]["cache_n"], static_cast<int>(head.size()));
}

TEST(DecoderHttpFake, DecodesAdoptedCellsWithOneEvaluatedToken) {
  FakeServer server(ShareAvailability::enabled);
  const Json own =
      server.post("/completion", {{"prompt", kPrompt}, {"n_predict", 6}, {"temperature", 0}, {"return_tokens", true}})
          .json();
  server.post("/slots/0?action=erase", Json::object());
  const Json shared = server.post("/slots/0?action=share", {{"socket", "/nonexistent/sock"}}).json();
  ASSERT_TRUE(shared.contains("share_id")) << shared.dump();
  EXPECT_EQ(server.engine().last_socket(), "/nonexistent/sock");
  const std::vector<int32_t> head(kPrompt.begin(), kPrompt.end() - 1);
  server.engine().provider_writes(head);
  const Json adopted =
      server.post("/slots/0?action=adopt", {{"tokens", head}, {"share_id", shared["share_id"]}}).json();
  EXPECT_EQ(adopted["n_adopted"], static_cast<int>(head.size()));
  const int64_t before = server.engine().n_evaluated();
  const Json reply =
      server
          .post("/completion",
                {{"prompt", kPrompt}, {"n_predict", 6}, {"temperature", 0}, {"id_slot", 0}, {"return_tokens", true}})
          .json();
  EXPECT_EQ(reply["tokens"], own["tokens"]);
  EXPECT_EQ(reply["timings"]["prompt_n"], 1);
  EXPECT_EQ(server.engine().n_evaluated() - before, static_cast<int64_t>(own["tokens"].size()));
}

TEST(DecoderHttpFake, RefusesAStaleShareIdAndTooManyTokensWith400) {
  FakeServer server(ShareAvailability::enabled, true, 16);
  const Json first = server.post("/slots/0?action=share", {{"socket", "/a"}}).json();
  const Json second = server.post("/slots/0?action=share", {{"socket", "/b"}}).json();
  ASSERT_NE(first["share_id"], second["share_id"]);
  expect_error(server.post("/slots/0?action=adopt", {{"tokens", {1, 2}}, {"share_id", first["share_id"]}}), 400,
               "invalid_request_error", "not the latest");
  expect_error(
      server.post("/slots/0?action=adopt", {{"tokens", std::vector<int32_t>(16, 1)}, {"share_id", second["share_id"]}}),
      400, "invalid_request_error", "do not fit");
  expect_error(server.post("/slots/0?action=adopt", {{"tokens", {1, 2}}}), 400, "invalid_request_error", "share_id");
  expect_error(server.post("/slots/0?action=share", Json::object()), 400, "invalid_request_error", "socket");
}

// Turn 1 of a conversation on the slot: returns what the slot's cells hold afterwards
// (the prompt and every generated token but the last, which was sampled, never decoded).
std::vector<int32_t> complete_turn_one(const FakeServer& server, const std::vector<int32_t>& prompt, int n_predict,
                                       std::vector<int32_t>* reply_tokens = nullptr) {
  const Json reply = server
                         .post("/completion", {{"prompt", prompt},
                                               {"n_predict", n_predict},
                                               {"temperature", 0},
                                               {"return_tokens", true},
                                               {"cache_prompt", false}})
                         .json();
  const auto generated = reply["tokens"].get<std::vector<int32_t>>();
  EXPECT_FALSE(generated.empty()) << reply.dump();
  if (reply_tokens != nullptr) *reply_tokens = generated;
  std::vector<int32_t> cached = prompt;
  if (!generated.empty()) cached.insert(cached.end(), generated.begin(), generated.end() - 1);
  EXPECT_EQ(server.get("/slots").json()[0]["n_prompt_tokens"], static_cast<int>(cached.size()));
  return cached;
}

TEST(DecoderHttpFake, AnswersShareWithTheCommonPrefixOfItsTokensAndTheSlotsCachedTokens) {
  FakeServer server(ShareAvailability::enabled);
  const std::vector<int32_t> cached = complete_turn_one(server, kPrompt, 4);
  const auto share = [&](const Json& body) { return server.post("/slots/0?action=share", body).json(); };

  std::vector<int32_t> longer = cached;  // turn 2: the cached tokens, then new ones
  longer.insert(longer.end(), {'!', ' ', 'o', 'k'});
  EXPECT_EQ(share({{"socket", "/s"}, {"tokens", longer}})["n_cached"], static_cast<int>(cached.size()));
  const std::vector<int32_t> diverging = {FakeEngine::kBos, 'h', 'e', 'X', 'Y'};
  EXPECT_EQ(share({{"socket", "/s"}, {"tokens", diverging}})["n_cached"], 3);
  const std::vector<int32_t> shorter(cached.begin(), cached.begin() + 5);  // capped at the tokens given
  EXPECT_EQ(share({{"socket", "/s"}, {"tokens", shorter}})["n_cached"], 5);
  EXPECT_EQ(share({{"socket", "/s"}, {"tokens", Json::array()}})["n_cached"], 0);
  EXPECT_EQ(share({{"socket", "/s"}})["n_cached"], 0);
  EXPECT_EQ(share({{"socket", "/s"}, {"tokens", nullptr}})["n_cached"], 0);
  // None of these shares touched the slot: its cells and tokens are what turn 1 left.
  EXPECT_EQ(server.get("/slots").json()[0]["n_prompt_tokens"], static_cast<int>(cached.size()));
  EXPECT_EQ(share({{"socket", "/s"}, {"tokens", longer}})["n_cached"], static_cast<int>(cached.size()));
}

TEST(DecoderHttpFake, RefusesShareTokensThatAreNotIdsOfTheVocabularyWith400BeforeSharing) {
  FakeServer server(ShareAvailability::enabled);
  for (const Json& tokens : {Json(-1), Json::array({1, "a"}), Json::array({1, -2}), Json::array({1, 1LL << 33}),
                             Json::array({1, FakeEngine::kVocab})}) {
    SCOPED_TRACE(tokens.dump());
    const HttpReply reply = server.post("/slots/0?action=share", {{"socket", "/never"}, {"tokens", tokens}});
    expect_error(reply, 400, "invalid_request_error", "tokens");
  }
  // The refusal names the element and what it was.
  expect_error(server.post("/slots/0?action=share", {{"socket", "/never"}, {"tokens", Json::array({1, "a"})}}), 400,
               "invalid_request_error", "element 1 is \"a\"");
  EXPECT_EQ(server.engine().last_socket(), "") << "a refused share reached the engine";
}

TEST(DecoderHttpFake, DecodesATurnTwoPromptWhoseProviderWroteOnlyTheCellsAfterTheCachedOnes) {
  FakeServer server(ShareAvailability::enabled);
  std::vector<int32_t> turn_one_reply;
  const std::vector<int32_t> cached = complete_turn_one(server, kPrompt, 4, &turn_one_reply);
  std::vector<int32_t> turn_two = kPrompt;
  turn_two.insert(turn_two.end(), turn_one_reply.begin(), turn_one_reply.end());
  turn_two.insert(turn_two.end(), {' ', 'm', 'o', 'r', 'e', '?'});
  const std::vector<int32_t> expected = expected_continuation(turn_two, 6);
  const std::vector<int32_t> head(turn_two.begin(), turn_two.end() - 1);

  const Json shared = server.post("/slots/0?action=share", {{"socket", "/s"}, {"tokens", head}}).json();
  const int n_cached = shared["n_cached"].get<int>();
  ASSERT_EQ(n_cached, static_cast<int>(cached.size()));
  // The fake's logits hash every cell: had the decoder's cells 0..n_cached-1 been lost,
  // the reply would differ.
  server.engine().provider_writes(head, static_cast<size_t>(n_cached));
  const Json adopted =
      server.post("/slots/0?action=adopt", {{"tokens", head}, {"share_id", shared["share_id"]}, {"n_cached", n_cached}})
          .json();
  EXPECT_EQ(adopted["n_adopted"], static_cast<int>(head.size())) << adopted.dump();
  const Json reply =
      server.post("/completion", {{"prompt", turn_two}, {"n_predict", 6}, {"temperature", 0}, {"return_tokens", true}})
          .json();
  EXPECT_EQ(reply["tokens"], Json(expected));
  EXPECT_EQ(reply["timings"]["prompt_n"], 1);
  EXPECT_EQ(reply["timings"]["cache_n"], static_cast<int>(head.size()));
}

TEST(DecoderHttpFake, RefusesAnAdoptWhoseCachedTokensTheSlotNoLongerHoldsAndKeepsTheSlot) {
  FakeServer server(ShareAvailability::enabled);
  const std::vector<int32_t> cached = complete_turn_one(server, kPrompt, 4);
  std::vector<int32_t> head = cached;
  head.insert(head.end(), {'?', '!'});
  const Json shared = server.post("/slots/0?action=share", {{"socket", "/s"}, {"tokens", head}}).json();
  const int n_cached = shared["n_cached"].get<int>();
  ASSERT_EQ(n_cached, static_cast<int>(cached.size()));
  const Json adopt_body = {{"tokens", head}, {"share_id", shared["share_id"]}, {"n_cached", n_cached}};

  // Reused between share and adopt: another prompt's completion replaced the cells.
  const std::vector<int32_t> other = {FakeEngine::kBos, 'h', 'i'};
  const std::vector<int32_t> reused = complete_turn_one(server, other, 2);
  expect_error(server.post("/slots/0?action=adopt", adopt_body), 400, "invalid_request_error",
               fmt::format("n_cached {}: the slot holds only 2 of these tokens", n_cached));
  EXPECT_EQ(server.get("/slots").json()[0]["n_prompt_tokens"], static_cast<int>(reused.size()));
  const Json after_refusal =
      server.post("/completion", {{"prompt", reused}, {"n_predict", 1}, {"temperature", 0}}).json();
  EXPECT_EQ(after_refusal["timings"]["cache_n"], static_cast<int>(reused.size()) - 1) << "the slot lost its cells";

  // Erased between share and adopt.
  server.post("/slots/0?action=erase", Json::object());
  expect_error(server.post("/slots/0?action=adopt", adopt_body), 400, "invalid_request_error",
               "the slot holds only 0 of these tokens");
  // An n_cached past the tokens, or not a count, is a bad body.
  expect_error(
      server.post("/slots/0?action=adopt", {{"tokens", {1, 2}}, {"share_id", shared["share_id"]}, {"n_cached", 3}}),
      400, "invalid_request_error", "n_cached");
  expect_error(
      server.post("/slots/0?action=adopt", {{"tokens", {1, 2}}, {"share_id", shared["share_id"]}, {"n_cached", -1}}),
      400, "invalid_request_error", "n_cached");
  // The refusals spent nothing: the share is still adoptable without the cached prefix.
  server.engine().provider_writes(head);
  const Json adopted =
      server.post("/slots/0?action=adopt", {{"tokens", head}, {"share_id", shared["share_id"]}, {"n_cached", 0}})
          .json();
  EXPECT_EQ(adopted["n_adopted"], static_cast<int>(head.size())) << adopted.dump();
}

// The decoder has no remote share of its own any more (its receiver runs in serve's
// kvshare-remote-receiver process): the old {"transport": "ucx"} body is a bad share body.
TEST(DecoderHttpFake, RefusesTheRetiredRemoteShareBodyNamingTheSocketField) {
  FakeServer server(ShareAvailability::enabled);
  expect_error(server.post("/slots/0?action=share", {{"transport", "ucx"}, {"n_tokens", 4}}), 400,
               "invalid_request_error", "socket");
}

TEST(DecoderHttpFake, AnswersShareWith501NamingBothCausesWhenTheFlagIsUnset) {
  FakeServer server;
  const HttpReply reply = server.post("/slots/0?action=share", {{"socket", "/a"}});
  expect_error(reply, 501, "not_supported_error", "ONEBIT_KV_SHARE");
  EXPECT_NE(reply.body.find("cannot export"), std::string::npos);
  expect_error(server.post("/slots/0?action=adopt", {{"tokens", {1}}, {"share_id", 1}}), 501, "not_supported_error",
               "ONEBIT_KV_SHARE");
}

TEST(DecoderHttpFake, AnswersSlotActionsWith501WithoutASlotSavePath) {
  FakeServer server(ShareAvailability::flag_not_set, false);
  for (const char* action : {"save", "restore", "erase"}) {
    expect_error(server.post(std::string("/slots/0?action=") + action, {{"filename", "a.bin"}}), 501,
                 "not_supported_error", "--slot-save-path");
  }
}

TEST(DecoderHttpFake, ChecksSlotIdThenActionThenFilenameInLlamaServersOrder) {
  FakeServer server;
  expect_error(server.post("/slots/x?action=save", {{"filename", "a.bin"}}), 400, "invalid_request_error",
               "Invalid slot ID");
  expect_error(server.post("/slots/0?action=fly", Json::object()), 400, "invalid_request_error", "Invalid action");
  expect_error(server.post("/slots/0", Json::object()), 400, "invalid_request_error", "Invalid action");
  for (const char* bad : {"../escape.bin", "..", ".", "a/b", "a\\b", " lead", "trail ", "dot.", "a:b", ""}) {
    expect_error(server.post("/slots/0?action=save", {{"filename", bad}}), 400, "invalid_request_error",
                 "Invalid filename");
  }
  // An overlong "/" (0xC0 0xAF) never reaches the name check: the JSON parser refuses the
  // body first (500, as llama-server's nlohmann parse does); SlotFilename covers the rule.
  expect_error(server.post_raw("/slots/0?action=save", "{\"filename\": \"a\xC0\xAF\"}"), 500, "server_error", "UTF-8");
  // One slot: every id wraps to slot 0 and the reply echoes the id that was sent.
  EXPECT_EQ(server.post("/slots/3?action=save", {{"filename", "a.bin"}}).json()["id_slot"], 3);
  EXPECT_EQ(server.post("/slots/-1?action=erase", Json::object()).json()["id_slot"], -1);
}

TEST(DecoderHttpFake, RefusesARestoreOfAMissingOrForeignFileAndForgetsTheSlot) {
  FakeServer server;
  server.post("/completion", {{"prompt", kPrompt}, {"n_predict", 0}});
  expect_error(server.post("/slots/0?action=restore", {{"filename", "missing.bin"}}), 400, "invalid_request_error",
               "Unable to restore slot");
  std::ofstream(server.dir() / "junk.bin") << "not a state file";
  expect_error(server.post("/slots/0?action=restore", {{"filename", "junk.bin"}}), 400, "invalid_request_error",
               "Unable to restore slot");
  EXPECT_EQ(server.get("/slots").json()[0]["n_prompt_tokens"], 0);
}

TEST(DecoderHttpFake, GivesLlamaServerStatusesForBadCompletionRequests) {
  FakeServer server;
  expect_error(server.post("/completion", {{"n_predict", 1}}), 400, "invalid_request_error", "prompt");
  expect_error(server.post_raw("/completion", "{not json"), 500, "server_error", "parse error");
  expect_error(server.post("/completion", {{"prompt", {1, 99999}}}), 400, "invalid_request_error", "invalid tokens");
  expect_error(server.post("/completion", {{"prompt", Json::array()}}), 400, "invalid_request_error",
               "must not be empty");
  expect_error(server.post("/completion", {{"prompt", "x"}, {"n_predict", "many"}}), 400, "invalid_request_error",
               "completion request: \"n_predict\" is \"many\", not a number");
  expect_error(server.post("/completion", {{"prompt", "x"}, {"n_predict", -2}}), 400, "invalid_request_error",
               "Value must be between");
  const HttpReply too_long = server.post("/completion", {{"prompt", std::vector<int32_t>(64, 'a')}});
  expect_error(too_long, 400, "exceed_context_size_error", "exceeds the available context size");
  EXPECT_EQ(too_long.json()["error"]["n_ctx"], 64);
  EXPECT_EQ(too_long.json()["error"]["n_prompt_tokens"], 64);
  expect_error(server.post_raw("/slots/0?action=save", "{}"), 500, "server_error", "filename");
  expect_error(server.post("/v1/chat/completions", {{"messages", "hi"}}), 400, "invalid_request_error",
               "Expected 'messages' to be an array");
}

TEST(DecoderHttpFake, StopsAtAStopWordAndLeavesItOut) {
  FakeServer server;
  // A prompt whose greedy continuation runs for at least 3 letters before any end token.
  std::vector<int32_t> prompt = kPrompt;
  while (expected_continuation(prompt, 8).size() < 3 || expected_continuation(prompt, 8)[2] >= 256)
    prompt.push_back('x');
  const auto continuation = expected_continuation(prompt, 8);
  const std::string stop(1, static_cast<char>(continuation[2]));
  const Json reply =
      server.post("/completion", {{"prompt", prompt}, {"n_predict", 8}, {"temperature", 0}, {"stop", stop}}).json();
  EXPECT_EQ(reply["stop_type"], "word");
  EXPECT_EQ(reply["stopping_word"], stop);
  EXPECT_EQ(reply["content"].get<std::string>().find(stop), std::string::npos);
}

TEST(DecoderHttpFake, StreamsNativeCompletionsAsDataEventsEndingWithTimings) {
  FakeServer server;
  const auto expected = expected_continuation(kPrompt, 5);
  const HttpReply reply =
      server.post("/completion", {{"prompt", kPrompt}, {"n_predict", 5}, {"temperature", 0}, {"stream", true}});
  EXPECT_EQ(reply.status, 200);
  EXPECT_NE(reply.content_type.find("text/event-stream"), std::string::npos);
  auto events = parse_sse_events(reply.body);
  ASSERT_TRUE(events) << events.error().what();
  ASSERT_EQ(events->size(), expected.size() + 1);
  for (size_t i = 0; i < expected.size(); ++i) {
    const Json chunk = Json::parse((*events)[i]);
    EXPECT_EQ(chunk["tokens"], Json({expected[i]}));
    EXPECT_EQ(chunk["stop"], false);
    EXPECT_FALSE(chunk.contains("timings"));
  }
  const Json last = Json::parse(events->back());
  EXPECT_EQ(last["stop"], true);
  EXPECT_EQ(last["content"], "");
  EXPECT_EQ(last["timings"]["prompt_n"], static_cast<int>(kPrompt.size()));
  EXPECT_EQ(reply.body.find("[DONE]"), std::string::npos);
}

TEST(DecoderHttpFake, StreamsChatCompletionsWithRoleFirstFinishChunkAndDone) {
  FakeServer server;
  const HttpReply reply = server.post("/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                                                               {"max_tokens", 4},
                                                               {"temperature", 0},
                                                               {"stream", true},
                                                               {"stream_options", {{"include_usage", true}}}});
  EXPECT_EQ(reply.status, 200);
  auto events = parse_sse_events(reply.body);
  ASSERT_TRUE(events) << events.error().what();
  ASSERT_GE(events->size(), 4u);
  EXPECT_EQ(events->back(), "[DONE]");
  const Json first = Json::parse(events->front());
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"], Json({{"role", "assistant"}, {"content", nullptr}}));
  std::string content;
  for (size_t i = 1; i + 3 < events->size(); ++i) {
    const Json chunk = Json::parse((*events)[i]);
    EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
    content += chunk["choices"][0]["delta"]["content"].get<std::string>();
    EXPECT_EQ(chunk["id"], first["id"]);
  }
  const Json finish = Json::parse((*events)[events->size() - 3]);
  EXPECT_FALSE(finish["choices"][0]["finish_reason"].is_null());
  const Json usage = Json::parse((*events)[events->size() - 2]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_GT(usage["usage"]["prompt_tokens"].get<int>(), 0);
  EXPECT_TRUE(usage.contains("timings"));
  const Json plain =
      server
          .post("/v1/chat/completions",
                {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 4}, {"temperature", 0}})
          .json();
  EXPECT_EQ(plain["choices"][0]["message"]["content"], content);
  EXPECT_EQ(plain["object"], "chat.completion");
  EXPECT_EQ(plain["usage"]["prompt_tokens_details"]["cached_tokens"], usage["usage"]["prompt_tokens"].get<int>() - 1);
}

TEST(DecoderHttpFake, StreamsOpenAiCompletionsWithAFinalUsageChunkAndDone) {
  FakeServer server;
  const HttpReply reply =
      server.post("/v1/completions", {{"prompt", "hello"}, {"max_tokens", 3}, {"temperature", 0}, {"stream", true}});
  auto events = parse_sse_events(reply.body);
  ASSERT_TRUE(events) << events.error().what();
  ASSERT_GE(events->size(), 3u);
  EXPECT_EQ(events->back(), "[DONE]");
  const Json last = Json::parse((*events)[events->size() - 2]);
  EXPECT_EQ(last["object"], "text_completion");
  EXPECT_FALSE(last["choices"][0]["finish_reason"].is_null());
  EXPECT_TRUE(last.contains("usage"));
  EXPECT_EQ(last["timings"]["prompt_n"], 6);
}

TEST(DecoderHttpFake, ShowsTheLastTaskInGetSlots) {
  FakeServer server;
  const Json fresh = server.get("/slots").json();
  ASSERT_EQ(fresh.size(), 1u);
  EXPECT_EQ(fresh[0].size(), 4u);  // id, n_ctx, speculative, is_processing
  server.post("/completion", {{"prompt", kPrompt}, {"n_predict", 0}});
  const Json slot = server.get("/slots").json()[0];
  EXPECT_EQ(slot["n_prompt_tokens"], static_cast<int>(kPrompt.size()));
  EXPECT_EQ(slot["n_prompt_tokens_processed"], static_cast<int>(kPrompt.size()));
  EXPECT_EQ(slot["is_processing"], false);
  EXPECT_TRUE(slot.contains("params"));
  EXPECT_TRUE(slot.contains("next_token"));
}

TEST(DecoderHttpFake, SerializesConcurrentRequestsOnTheOneSlot) {
  FakeServer server;
  const auto expected = expected_continuation(kPrompt, 6);
  std::vector<std::thread> threads;
  std::vector<Json> replies(6);
  for (size_t i = 0; i < replies.size(); ++i) {
    threads.emplace_back([&, i] {
      replies[i] =
          server
              .post("/completion", {{"prompt", kPrompt}, {"n_predict", 6}, {"temperature", 0}, {"return_tokens", true}})
              .json();
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& reply : replies) EXPECT_EQ(reply["tokens"], Json(expected));
}

}  // namespace
}  // namespace kvshare::decoder
