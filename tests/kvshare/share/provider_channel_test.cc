// The provider's end of the resident provider channel (kvshare/share/provider_channel.h):
// this test plays kvshare-serve on the other end of a socket pair (or of the provider's
// listening socket), sending frames the way serve does and ones serve must not.
#include "kvshare/share/provider_channel.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvshare/handshake/transport.h"
#include "kvshare/region/exporter.h"
#include "layout/share_header.h"
#include "share_fixtures.h"
#include "support/test_support.h"

namespace kvshare {
namespace {

using testing::FdLeakCheck;

constexpr int kDeadlineMs = static_cast<int>(std::chrono::milliseconds(testing::kLoadedDeadline).count());

// serve's end and the provider's end of one channel, as `kvshare-serve` makes it for
// `--serve-fd`.
struct Channel {
  Fd serve;
  std::optional<ProviderChannel> provider;
  Channel() {
    int ends[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ends) != 0) {
      ADD_FAILURE() << "socketpair: " << std::strerror(errno);
      return;
    }
    serve.reset(ends[0]);
    auto channel = ProviderChannel::from_fd(Fd(ends[1]));
    if (!channel) {
      ADD_FAILURE() << channel.error().what();
      return;
    }
    provider.emplace(std::move(*channel));
  }
  std::string who() const { return fmt::format("kvshare-serve (pid {})", ::getpid()); }
};

Fd sealed_memfd(uint64_t size_bytes) {
  Fd fd(::memfd_create("provider-channel-test", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  EXPECT_EQ(::ftruncate(fd.get(), static_cast<off_t>(size_bytes)), 0);
  EXPECT_EQ(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  return fd;
}

void send_text(int socket_fd, std::string_view text, std::span<const int> fds = {}) {
  auto sent = handshake::send_frame(socket_fd, handshake::length_prefixed(text), fds, kDeadlineMs, "test request");
  ASSERT_TRUE(sent) << sent.error().what();
}

void send_request(int socket_fd, const ProviderRequest& request, std::span<const int> fds = {}) {
  send_text(socket_fd, encode_provider_request(request), fds);
}

Result<ProviderReply> receive_reply(int socket_fd) {
  auto frame =
      handshake::receive_frame(socket_fd, kDeadlineMs, "the provider", -1, "test reply", kMaxProviderMessageBytes);
  if (!frame) return fail(frame.error());
  if (!frame->fds.empty()) return fail(EPROTO, "a reply carried {} fd(s)", frame->fds.size());
  return parse_provider_reply({reinterpret_cast<const char*>(frame->body.data()), frame->body.size()}, "reply");
}

// The small llama-shaped header (one 262144-byte chunk) and memfd regions for it, as a
// decoder exports them; `region_request` is serve's request forwarding their share.
struct Region {
  layout::ShareHeader header = testing::small_share_header();
  std::vector<ExportedRegion> regions;
  Region() {
    ExportOptions options;
    options.forced = RegionBackend::memfd;
    auto exported = export_regions(header.layout, options);
    if (!exported) {
      ADD_FAILURE() << exported.error().what();
      return;
    }
    regions = std::move(*exported);
  }
  ProviderRequest region_request(uint64_t region_id, uint64_t share_id) const {
    ProviderRequest request{.op = ProviderOp::region, .region_id = region_id};
    request.share.share_id = share_id;
    request.share.header_json = layout::to_json(header, false);
    for (const auto& region : regions)
      request.share.fds.push_back({region.chunk, std::string(region_backend_name(region.backend)), region.offset,
                                   region.size_bytes, region.layout_hash});
    return request;
  }
  std::vector<int> fds() const {
    std::vector<int> numbers;
    for (const auto& region : regions) numbers.push_back(region.fd.get());
    return numbers;
  }
};

const ProviderRequest kSharedPrefill{.op = ProviderOp::prefill,
                                     .region_id = 1,
                                     .route = PrefillRoute::shared,
                                     .share_id = 2,
                                     .n_cached = 1,
                                     .tokens = {1, 2, 3}};

class ProviderChannelTest : public FdLeakCheck {};

TEST_F(ProviderChannelTest, SaysHelloThenTakesRequestsAndRepliesInOrder) {
  Channel channel;
  ASSERT_TRUE(channel.provider);
  EXPECT_EQ(channel.provider->peer().pid, ::getpid());
  const ProviderReply hello{.op = ProviderOp::hello, .pid = static_cast<uint64_t>(::getpid()), .takes_file = false};
  ASSERT_TRUE(channel.provider->say_hello(hello));
  auto said = receive_reply(channel.serve.get());
  ASSERT_TRUE(said) << said.error().what();
  EXPECT_EQ(said->op, ProviderOp::hello);
  EXPECT_EQ(said->pid, static_cast<uint64_t>(::getpid()));
  EXPECT_TRUE(said->takes_shared);
  EXPECT_FALSE(said->takes_file);

  const ProviderRequest file{.op = ProviderOp::prefill,
                             .route = PrefillRoute::file,
                             .tokens = {9, 8},
                             .state_file = "/tmp/x.state",
                             .state_version = 3,
                             .kv = {512, "f16", "q8_0", false}};
  send_request(channel.serve.get(), kSharedPrefill);
  send_request(channel.serve.get(), file);
  auto first = channel.provider->next(kDeadlineMs);
  ASSERT_TRUE(first) << first.error().what();
  EXPECT_EQ(first->request.route, PrefillRoute::shared);
  EXPECT_EQ(first->request.share_id, 2u);
  EXPECT_EQ(first->request.n_cached, 1u);
  EXPECT_EQ(first->request.tokens, kSharedPrefill.tokens);
  EXPECT_FALSE(first->region);
  ASSERT_TRUE(channel.provider->reply({.op = ProviderOp::prefill, .prefill_ms = 1.5, .n_prefilled = 2}));
  auto second = channel.provider->next(kDeadlineMs);
  ASSERT_TRUE(second) << second.error().what();
  EXPECT_EQ(second->request.route, PrefillRoute::file);
  EXPECT_EQ(second->request.state_file, "/tmp/x.state");
  EXPECT_EQ(second->request.kv, file.kv);
  ASSERT_TRUE(channel.provider->reply(
      {.op = ProviderOp::prefill, .ok = false, .error_errno = ENOSPC, .error = "writing /tmp/x.state: no room"}));

  auto replied = receive_reply(channel.serve.get());
  ASSERT_TRUE(replied) << replied.error().what();
  EXPECT_TRUE(replied->ok);
  EXPECT_EQ(replied->n_prefilled, 2u);
  auto refused = receive_reply(channel.serve.get());
  ASSERT_TRUE(refused) << refused.error().what();
  EXPECT_FALSE(refused->ok);
  EXPECT_EQ(refused->error_errno, ENOSPC);
  EXPECT_EQ(refused->error, "writing /tmp/x.state: no room");
}

TEST_F(ProviderChannelTest, RefusesToSayAnythingButHelloFirst) {
  Channel channel;
  ASSERT_TRUE(channel.provider);
  auto said = channel.provider->say_hello({.op = ProviderOp::region, .region_id = 1});
  ASSERT_FALSE(said);
  EXPECT_EQ(said.error().errno_value(), EINVAL);
  EXPECT_NE(said.error().message().find("the first frame on the channel must be hello"), std::string::npos)
      << said.error().what();
}

TEST_F(ProviderChannelTest, RefusesAPrefillFrameCarryingAnFdAndClosesTheFd) {
  Channel channel;
  ASSERT_TRUE(channel.provider);
  {
    const Fd stray = sealed_memfd(4096);
    const int stray_fd = stray.get();
    send_request(channel.serve.get(), kSharedPrefill, std::span<const int>(&stray_fd, 1));
  }
  const auto before = testing::open_fds();
  auto call = channel.provider->next(kDeadlineMs);
  ASSERT_FALSE(call);
  EXPECT_EQ(call.error().errno_value(), EPROTO);
  EXPECT_NE(call.error().message().find(channel.who() + ": a prefill request carried 1 fd(s); only a region does"),
            std::string::npos)
      << call.error().what();
  // The fd that arrived with the frame is closed again: nothing new is open.
  EXPECT_EQ(testing::open_fds(), before);
}

TEST_F(ProviderChannelTest, ClosesTheFdsOfAFrameThatDoesNotParse) {
  Channel channel;
  ASSERT_TRUE(channel.provider);
  {
    const Fd stray = sealed_memfd(4096);
    const int stray_fd = stray.get();
    send_text(channel.serve.get(), R"({"kvshare_provider":1,"op":"region","region_id":1,"share":)",
              std::span<const int>(&stray_fd, 1));
  }
  const auto before = testing::open_fds();
  auto call = channel.provider->next(kDeadlineMs);
  ASSERT_FALSE(call);
  EXPECT_EQ(call.error().errno_value(), EINVAL);
  EXPECT_NE(call.error().message().find(channel.who() + ": not JSON"), std::string::npos) << call.error().what();
  EXPECT_EQ(testing::open_fds(), before);
}

TEST_F(ProviderChannelTest, DeliversARegionWhoseMemfdsMatchItsHeaderWithThePagesShared) {
  Channel channel;
  ASSERT_TRUE(channel.provider);
  Region region;
  ASSERT_EQ(region.regions.size(), 1u);
  send_request(channel.serve.get(), region.region_request(1, 5), region.fds());
  auto call = channel.provider->next(kDeadlineMs);
  ASSERT_TRUE(call) << call.error().what();
  EXPECT_EQ(call->request.op, ProviderOp::region);
  EXPECT_EQ(call->request.region_id, 1u);
  ASSERT_TRUE(call->region);
  EXPECT_EQ(call->region->share_id, 5u);
  EXPECT_EQ(call->region->peer.pid, ::getpid());
  EXPECT_EQ(layout::to_json(call->region->header, false), layout::to_json(region.header, false));
  ASSERT_EQ(call->region->fds.size(), 1u);
  EXPECT_EQ(call->region->entries[0].size_bytes, 262144u);
  // The fd is the decoder's region: a byte the decoder writes reads back through it.
  region.regions[0].mapping.bytes()[4096 + 7] = std::byte{0x5a};
  auto mapped = Mapping::map(call->region->fds[0].get(), 0, 262144, true, "received chunk 0");
  ASSERT_TRUE(mapped) << mapped.error().what();
  EXPECT_EQ(mapped->bytes()[4096 + 7], std::byte{0x5a});
  ASSERT_TRUE(channel.provider->reply({.op = ProviderOp::region, .region_id = 1, .region_ms = 0.5}));
  auto replied = receive_reply(channel.serve.get());
  ASSERT_TRUE(replied) << replied.error().what();
  EXPECT_EQ(replied->region_id, 1u);
}

TEST_F(ProviderChannelTest, RefusesARegionWithMoreFdsThanItsShareLists) {
  Channel channel;
  ASSERT_TRUE(channel.provider);
  Region region;
  const Fd extra = sealed_memfd(262144);
  std::vector<int> fds = region.fds();
  fds.push_back(extra.get());
  send_request(channel.serve.get(), region.region_request(1, 5), fds);
  const auto before = testing::open_fds();
  auto call = channel.provider->next(kDeadlineMs);
  ASSERT_FALSE(call);
  EXPECT_EQ(call.error().errno_value(), EPROTO);
  EXPECT_NE(call.error().message().find("handshake from " + channel.who() + ": 2 fd(s) arrived, field \"fds\" lists 1"),
            std::string::npos)
      << call.error().what();
  EXPECT_EQ(testing::open_fds(), before);
}

TEST_F(ProviderChannelTest, RefusesARegionWhoseShareListsOtherSizesThanItsHeader) {
  Channel channel;
  ASSERT_TRUE(channel.provider);
  Region region;
  ProviderRequest request = region.region_request(1, 5);
  request.share.fds[0].size_bytes = 4096;
  send_request(channel.serve.get(), request, region.fds());
  auto call = channel.provider->next(kDeadlineMs);
  ASSERT_FALSE(call);
  EXPECT_EQ(call.error().errno_value(), EINVAL);
  EXPECT_NE(call.error().message().find("field \"fds[0].size_bytes\" is 4096, the header says 262144"),
            std::string::npos)
      << call.error().what();
}

TEST_F(ProviderChannelTest, RefusesARegionWhoseFdIsShorterThanItsHeaderSays) {
  Channel channel;
  ASSERT_TRUE(channel.provider);
  Region region;
  const Fd short_memfd = sealed_memfd(4096);
  const int short_fd = short_memfd.get();
  send_request(channel.serve.get(), region.region_request(1, 5), std::span<const int>(&short_fd, 1));
  const auto before = testing::open_fds();
  auto call = channel.provider->next(kDeadlineMs);
  ASSERT_FALSE(call);
  EXPECT_EQ(call.error().errno_value(), EINVAL);
  EXPECT_NE(call.error().message().find("(chunk 0): memfd is 4096 bytes, the layout needs 262144"), std::string::npos)
      << call.error().what();
  EXPECT_EQ(testing::open_fds(), before);
}

TEST_F(ProviderChannelTest, RefusesARegionWithoutFds) {
  Channel channel;
  ASSERT_TRUE(channel.provider);
  Region region;
  send_request(channel.serve.get(), region.region_request(1, 5));
  auto call = channel.provider->next(kDeadlineMs);
  ASSERT_FALSE(call);
  EXPECT_EQ(call.error().errno_value(), EPROTO);
  EXPECT_NE(call.error().message().find("0 fd(s) arrived, field \"fds\" lists 1"), std::string::npos)
      << call.error().what();
}

TEST_F(ProviderChannelTest, EndsWithEnodataWhenServeClosesBetweenRequests) {
  Channel channel;
  ASSERT_TRUE(channel.provider);
  send_request(channel.serve.get(), kSharedPrefill);
  channel.serve.reset();
  ASSERT_TRUE(channel.provider->next(kDeadlineMs));
  auto call = channel.provider->next(kDeadlineMs);
  ASSERT_FALSE(call);
  EXPECT_EQ(call.error().errno_value(), ENODATA);
  EXPECT_NE(call.error().message().find(channel.who() + " closed the channel"), std::string::npos)
      << call.error().what();
}

TEST_F(ProviderChannelTest, RefusesAFrameCutShortWithEproto) {
  Channel channel;
  ASSERT_TRUE(channel.provider);
  const std::string text = encode_provider_request(kSharedPrefill);
  const auto frame = handshake::length_prefixed(text);
  ASSERT_EQ(::send(channel.serve.get(), frame.data(), 20, MSG_NOSIGNAL), 20);
  channel.serve.reset();
  auto call = channel.provider->next(kDeadlineMs);
  ASSERT_FALSE(call);
  EXPECT_EQ(call.error().errno_value(), EPROTO);
  const std::string words = fmt::format("short read: peer closed the socket at byte 20 of {}", frame.size());
  EXPECT_NE(call.error().message().find(words), std::string::npos) << call.error().what();
}

TEST_F(ProviderChannelTest, TimesOutWhenServeSaysNothing) {
  Channel channel;
  ASSERT_TRUE(channel.provider);
  auto call = channel.provider->next(0);
  ASSERT_FALSE(call);
  EXPECT_EQ(call.error().errno_value(), ETIMEDOUT);
  EXPECT_NE(call.error().message().find("no request from " + channel.who() + " within 0 ms"), std::string::npos)
      << call.error().what();
}

TEST_F(ProviderChannelTest, RefusesAServeFdThatIsNotASocket) {
  int pipe_fds[2];
  ASSERT_EQ(::pipe2(pipe_fds, O_CLOEXEC), 0);
  const Fd write_end(pipe_fds[1]);
  auto channel = ProviderChannel::from_fd(Fd(pipe_fds[0]));  // takes (and closes) the read end
  ASSERT_FALSE(channel);
  EXPECT_EQ(channel.error().errno_value(), ENOTSOCK);
  EXPECT_NE(channel.error().message().find(fmt::format("--serve-fd {}: not a socket", pipe_fds[0])), std::string::npos)
      << channel.error().what();
}

TEST_F(ProviderChannelTest, RefusesAServeFdThatIsADatagramSocket) {
  int ends[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, ends), 0);
  const Fd other(ends[1]);
  auto channel = ProviderChannel::from_fd(Fd(ends[0]));
  ASSERT_FALSE(channel);
  EXPECT_EQ(channel.error().errno_value(), ENOTSOCK);
  EXPECT_NE(channel.error().message().find("not a stream socket"), std::string::npos) << channel.error().what();
}

class ProviderListenerTest : public FdLeakCheck {};

TEST_F(ProviderListenerTest, AcceptsServeAndCarriesTheHello) {
  testing::TempDir dir;  // mkdtemp: 0700, ours
  const auto path = dir / "provider.sock";
  auto listener = ProviderListener::listen(path);
  ASSERT_TRUE(listener) << listener.error().what();
  EXPECT_EQ(listener->socket_path(), path.string());
  // serve connects as kvshare-serve --prefill-provider-socket PATH does; the connection
  // waits in the backlog until accept.
  auto serve = handshake::connect_checked_listener(path.string(), kDeadlineMs);
  ASSERT_TRUE(serve) << serve.error().what();
  auto channel = listener->accept(kDeadlineMs);
  ASSERT_TRUE(channel) << channel.error().what();
  EXPECT_EQ(channel->peer().pid, ::getpid());
  ASSERT_TRUE(channel->say_hello({.op = ProviderOp::hello, .pid = 1}));
  auto said = receive_reply(serve->get());
  ASSERT_TRUE(said) << said.error().what();
  EXPECT_EQ(said->op, ProviderOp::hello);
  send_request(serve->get(), kSharedPrefill);
  auto call = channel->next(kDeadlineMs);
  ASSERT_TRUE(call) << call.error().what();
  EXPECT_EQ(call->request.tokens, kSharedPrefill.tokens);
}

TEST_F(ProviderListenerTest, RemovesItsSocketWhenDestroyed) {
  testing::TempDir dir;
  const auto path = dir / "provider.sock";
  {
    auto listener = ProviderListener::listen(path);
    ASSERT_TRUE(listener) << listener.error().what();
    EXPECT_TRUE(std::filesystem::exists(path));
  }
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST_F(ProviderListenerTest, RefusesADirectoryOthersCanReach) {
  testing::TempDir dir;
  const auto open_dir = dir / "open";
  ASSERT_EQ(::mkdir(open_dir.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(open_dir.c_str(), 0755), 0);
  auto listener = ProviderListener::listen(open_dir / "provider.sock");
  ASSERT_FALSE(listener);
  EXPECT_EQ(listener.error().errno_value(), EPERM);
  EXPECT_NE(listener.error().message().find("--serve " + (open_dir / "provider.sock").string()), std::string::npos)
      << listener.error().what();
  EXPECT_NE(listener.error().message().find(open_dir.string()), std::string::npos) << listener.error().what();
  EXPECT_FALSE(std::filesystem::exists(open_dir / "provider.sock"));
}

TEST_F(ProviderListenerTest, RefusesAPathWhereSomethingIsAlready) {
  testing::TempDir dir;
  const auto path = dir / "provider.sock";
  std::ofstream(path) << "stale";
  auto listener = ProviderListener::listen(path);
  ASSERT_FALSE(listener);
  EXPECT_EQ(listener.error().errno_value(), EEXIST);
  EXPECT_NE(listener.error().message().find("--serve " + path.string() + ": something is there already"),
            std::string::npos)
      << listener.error().what();
  EXPECT_TRUE(std::filesystem::exists(path)) << "the stale file is the user's to remove";
}

TEST_F(ProviderListenerTest, RefusesARelativePath) {
  auto listener = ProviderListener::listen("provider.sock");
  ASSERT_FALSE(listener);
  EXPECT_EQ(listener.error().errno_value(), EINVAL);
  EXPECT_NE(listener.error().message().find("expected an absolute socket path"), std::string::npos)
      << listener.error().what();
}

}  // namespace
}  // namespace kvshare
