// serve's side of the remote route's state variant (route/remote_state.h): the binding it
// expects, the route it resolves, and fetch_remote_state against a one-shot HTTP peer that
// answers a canned reply: a good payload lands as a 0600 file, every other reply is refused
// with the errno the handoff maps to its fallback reason, and nothing is left behind.
#include "route/remote_state.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <string>
#include <thread>

#include "kvshare/fd.h"
#include "layout/remote_state_payload.h"
#include "route/handoff.h"
#include "route/serve_config.h"
#include "support/test_support.h"

namespace kvshare::route {
namespace {

const std::vector<int32_t> kIds = {39, 72, 106, 105, 0};

layout::RemoteStateBinding binding_for(const std::vector<int32_t>& ids = kIds) {
  ServeConfig config;
  auto b = expected_state_binding({"0x4d6f64656c2d6670", "0x546f6b656e697a72"}, config, 3, ids);
  EXPECT_TRUE(b);
  return *b;
}

// Accepts one connection on 127.0.0.1, reads the request (headers and Content-Length
// bytes) into `request` and answers `reply` as it is.
class OneShotPeer {
 public:
  explicit OneShotPeer(std::string reply) : reply_(std::move(reply)) {
    listen_ = Fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(listen_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(::listen(listen_.get(), 1), 0);
    socklen_t len = sizeof(addr);
    ::getsockname(listen_.get(), reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~OneShotPeer() {
    ::shutdown(listen_.get(), SHUT_RDWR);
    thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  std::string request;

 private:
  void serve() {
    Fd conn(::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!conn) return;
    char buf[4096];
    size_t want = std::string::npos;
    while (want == std::string::npos || request.size() < want) {
      const ssize_t n = ::read(conn.get(), buf, sizeof(buf));
      if (n <= 0) break;
      request.append(buf, static_cast<size_t>(n));
      const size_t end = request.find("\r\n\r\n");
      if (want == std::string::npos && end != std::string::npos) {
        const size_t at = request.find("Content-Length: ");
        want = end + 4 + (at == std::string::npos ? 0 : std::stoul(request.substr(at + 16)));
      }
    }
    size_t done = 0;
    while (done < reply_.size()) {
      const ssize_t n = ::write(conn.get(), reply_.data() + done, reply_.size() - done);
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
  }
  std::string reply_;
  Fd listen_;
  int port_ = 0;
  std::thread thread_;
};

std::string http_reply(int status, const std::string& body, const std::string& type,
                       const std::string& extra_headers = "") {
  return "HTTP/1.1 " + std::to_string(status) + " X\r\nContent-Type: " + type +
         "\r\nContent-Length: " + std::to_string(body.size()) + "\r\nConnection: close\r\n" + extra_headers + "\r\n" +
         body;
}

std::string payload_text(const layout::RemoteStateBinding& b, const std::string& state) {
  const auto bytes =
      layout::encode_remote_state(b, std::span(reinterpret_cast<const std::byte*>(state.data()), state.size()));
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

Result<FetchedState> fetch(const OneShotPeer& peer, const std::filesystem::path& path) {
  return fetch_remote_state(peer.url(), "k3y", std::chrono::milliseconds(20000), kIds, binding_for(), path);
}

TEST(RemoteRouteKind, ParsesTheThreeNamesAndRefusesOthers) {
  EXPECT_EQ(*parse_remote_route_kind("auto"), RemoteRouteKind::automatic);
  EXPECT_EQ(*parse_remote_route_kind("ucx"), RemoteRouteKind::ucx);
  EXPECT_EQ(*parse_remote_route_kind("state"), RemoteRouteKind::state);
  auto bad = parse_remote_route_kind("file");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message().find("expected auto, ucx or state"), std::string::npos);
}

TEST(RemoteRouteKind, AutoIsUcxForADecoderThatSharesAndStateOtherwise) {
  EXPECT_EQ(resolve_remote_route(RemoteRouteKind::automatic, true), RemoteRouteKind::ucx);
  EXPECT_EQ(resolve_remote_route(RemoteRouteKind::automatic, false), RemoteRouteKind::state);
  EXPECT_EQ(resolve_remote_route(RemoteRouteKind::state, true), RemoteRouteKind::state);
  EXPECT_EQ(resolve_remote_route(RemoteRouteKind::ucx, false), RemoteRouteKind::ucx);
}

TEST(HybridLine, RemoteStateRouteSaysRestoreThenRemoteState) {
  HandoffReport r;
  r.route = HandoffRoute::remote_state;
  r.n_prompt_tokens = 307;
  r.prefill_ms = 95.1234;
  r.handoff_ms = 6.5;
  EXPECT_EQ(hybrid_line(r, 140.0),
            "hybrid: 307 prompt tokens: prefill 95.123 ms, restore 6.500 ms remote-state, first byte 140.000 ms");
}

TEST(ExpectedStateBinding, NamesTheKvFlagsAsTheDecoderRunsThem) {
  ServeConfig config;
  config.flash_attn = "off";
  config.cache_type_k = "q8_0";
  auto b = expected_state_binding({"0x0000000000000001", "0x0000000000000002"}, config, 2, kIds);
  ASSERT_TRUE(b) << b.error().what();
  EXPECT_EQ(b->cache_type_k, "q8_0");
  EXPECT_EQ(b->cache_type_v, "f16");
  EXPECT_TRUE(b->v_trans);
  EXPECT_EQ(b->state_version, 2u);
  EXPECT_EQ(b->n_tokens, 5u);
  EXPECT_EQ(b->tokens_hash, "0x1752ff22dd993129");  // the vector's (tests/data/remote-state-v1.bin)
}

TEST(ModelIdentity, FingerprintsTheGgufOnceAndNamesAMissingFile) {
  auto a = model_identity(kvshare::testing::data_path("gguf-tiny.gguf"));
  ASSERT_TRUE(a) << a.error().what();
  EXPECT_EQ(a->model_hash.size(), 18u);
  EXPECT_EQ(a->tokenizer_hash.size(), 18u);
  auto again = model_identity(kvshare::testing::data_path("gguf-tiny.gguf"));
  ASSERT_TRUE(again);
  EXPECT_EQ(again->model_hash, a->model_hash);
  auto missing = model_identity("/nonexistent/model.gguf");
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.error().message().find("/nonexistent/model.gguf"), std::string::npos);
}

TEST(FetchRemoteState, WritesTheStateBytesAs0600AndSendsTheKeyAndBinding) {
  kvshare::testing::TempDir dir;
  OneShotPeer peer(http_reply(200, payload_text(binding_for(), "STATEBYTES"), "application/octet-stream",
                              "X-Kvshare-Prefill-Ms: 12.500\r\n"));
  auto fetched = fetch(peer, dir / "s.state");
  ASSERT_TRUE(fetched) << fetched.error().what();
  EXPECT_EQ(fetched->state_bytes, 10u);
  EXPECT_DOUBLE_EQ(fetched->prefill_ms, 12.5);
  EXPECT_EQ(kvshare::testing::read_file_bytes(dir / "s.state").size(), 10u);
  struct stat st {};
  ASSERT_EQ(::stat((dir / "s.state").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_NE(peer.request.find("POST /prefill-state"), std::string::npos);
  EXPECT_NE(peer.request.find("Authorization: Bearer k3y"), std::string::npos);
  EXPECT_NE(peer.request.find("\"tokens_hash\":\"0x1752ff22dd993129\""), std::string::npos);
}

TEST(FetchRemoteState, RefusesAPayloadForAnotherModelNamingTheFieldAndWritesNothing) {
  kvshare::testing::TempDir dir;
  layout::RemoteStateBinding other = binding_for();
  other.model = "0x00000000000000ff";
  OneShotPeer peer(http_reply(200, payload_text(other, "STATE"), "application/octet-stream"));
  auto fetched = fetch(peer, dir / "s.state");
  ASSERT_FALSE(fetched);
  EXPECT_EQ(fetched.error().errno_value(), EINVAL);
  EXPECT_NE(fetched.error().message().find("field \"model\": the remote state is for model 0x00000000000000ff"),
            std::string::npos)
      << fetched.error().message();
  EXPECT_FALSE(std::filesystem::exists(dir / "s.state"));
}

TEST(FetchRemoteState, RefusesATruncatedPayload) {
  kvshare::testing::TempDir dir;
  std::string text = payload_text(binding_for(), "STATEBYTES");
  text.resize(text.size() - 3);
  OneShotPeer peer(http_reply(200, text, "application/octet-stream"));
  auto fetched = fetch(peer, dir / "s.state");
  ASSERT_FALSE(fetched);
  EXPECT_EQ(fetched.error().errno_value(), EPROTO);
  EXPECT_NE(fetched.error().message().find("truncated"), std::string::npos) << fetched.error().message();
  EXPECT_FALSE(std::filesystem::exists(dir / "s.state"));
}

TEST(FetchRemoteState, A401IsEaccesAndA400IsARefusalWithThePeersWords) {
  kvshare::testing::TempDir dir;
  {
    OneShotPeer peer(http_reply(401, R"({"error":{"message":"Invalid API Key","code":401}})", "application/json"));
    auto fetched = fetch(peer, dir / "a.state");
    ASSERT_FALSE(fetched);
    EXPECT_EQ(fetched.error().errno_value(), EACCES);
    EXPECT_NE(fetched.error().message().find("answered 401 (Invalid API Key)"), std::string::npos)
        << fetched.error().message();
    EXPECT_EQ(fetched.error().message().find("k3y"), std::string::npos);
  }
  {
    OneShotPeer peer(http_reply(400, R"({"error":{"message":"prefill-state: field \"model\": other","code":400}})",
                                "application/json"));
    auto fetched = fetch(peer, dir / "b.state");
    ASSERT_FALSE(fetched);
    EXPECT_EQ(fetched.error().errno_value(), EINVAL);
    EXPECT_NE(fetched.error().message().find("refused the request: prefill-state: field \"model\""), std::string::npos)
        << fetched.error().message();
  }
}

TEST(FetchRemoteState, NoListenerIsConnectionRefused) {
  kvshare::testing::TempDir dir;
  auto fetched = fetch_remote_state("http://127.0.0.1:9", "", std::chrono::milliseconds(5000), kIds, binding_for(),
                                    dir / "s.state");
  ASSERT_FALSE(fetched);
  EXPECT_EQ(fetched.error().errno_value(), ECONNREFUSED);
}

TEST(ServeConfigValidate, RefusesARemoteRouteWithoutPrefillRemote) {
  ServeConfig config;
  config.model = kvshare::testing::data_path("gguf-tiny.gguf");
  config.prefill_remote_route = RemoteRouteKind::state;
  auto valid = validate(config);
  ASSERT_FALSE(valid);
  EXPECT_NE(valid.error().message().find("--prefill-remote-route state without --prefill-remote"), std::string::npos)
      << valid.error().message();
}

}  // namespace
}  // namespace kvshare::route
