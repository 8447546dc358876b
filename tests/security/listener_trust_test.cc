// The sender checks the receiver: DecoderShare::share (the one sender of KV fds, what
// kvshare-decoder and the patched llama-server call) refuses every listener another uid
// could own or reach, and sends it nothing. Bug pinned: share connected to any path it was
// given, abstract names included, and sent read-write fds of the whole KV cache.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

#include <gmock/gmock.h>

#include "attack_support.h"
#include "kvshare/handshake/transport.h"
#include "kvshare/share/broker.h"
#include "kvshare/share/decoder_share.h"
#include "kvshare/share/share_fixtures.h"
#include "support/test_support.h"

namespace kvshare::security {
namespace {

using ::testing::HasSubstr;

ExportOptions memfd_only() {
  ExportOptions options;
  options.forced = RegionBackend::memfd;
  return options;
}

DecoderShare exporting_decoder() {
  return DecoderShare::start(kvshare::testing::small_share_header(), true, memfd_only());
}

void expect_refusal(const Result<uint64_t>& share_id, int errno_value, const std::string& words) {
  ASSERT_FALSE(share_id) << "the share went through";
  EXPECT_EQ(share_id.error().errno_value(), errno_value) << share_id.error().what();
  EXPECT_THAT(share_id.error().message(), HasSubstr(words));
}

class ListenerTrust : public kvshare::testing::FdLeakCheck {};

TEST_F(ListenerTrust, SharesWithTheBrokersOwnSocket) {
  auto decoder = exporting_decoder();
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker) << broker.error().what();
  auto share_id = decoder.share(broker->socket_path(), 0, 2000);
  ASSERT_TRUE(share_id) << share_id.error().what();
  auto share = broker->receive(2000);
  ASSERT_TRUE(share) << share.error().what();
  EXPECT_EQ(share->fds.size(), decoder.regions().size());
}

TEST_F(ListenerTrust, RefusesAListenerOfAnotherUidAndSendsItNoFd) {
  KVSHARE_NEED_ROOT();
  // nobody listens in its own directory; the socket is then moved into our 0700
  // directory, so every path check passes and only SO_PEERCRED can tell (as after a
  // directory swapped between the checks and the connect).
  SharedTmpDir ours;
  SharedTmpDir theirs(kNobodyUid, 0700);
  const std::string their_path = theirs / "evil.sock";
  const std::string our_path = ours / "share.sock";
  int ready[2], report[2];
  ASSERT_EQ(::pipe2(ready, O_CLOEXEC), 0);
  ASSERT_EQ(::pipe2(report, O_CLOEXEC), 0);
  const sockaddr_un address = unix_address(their_path);
  const pid_t child = fork_as_nobody([&] {
    const int listener = listen_at(address, sizeof address);
    const char ok = listener >= 0 ? 'y' : 'n';
    (void)!::write(ready[1], &ok, 1);
    if (listener < 0) return 2;
    const Arrivals seen = accept_and_drain(listener, 3000);
    (void)!::write(report[1], &seen, sizeof seen);
    return 0;
  });
  ::close(ready[1]);
  ::close(report[1]);
  char ok = 'n';
  ASSERT_EQ(::read(ready[0], &ok, 1), 1);
  ASSERT_EQ(ok, 'y');
  ASSERT_EQ(::rename(their_path.c_str(), our_path.c_str()), 0) << std::strerror(errno);

  auto decoder = exporting_decoder();
  expect_refusal(decoder.share(our_path, 0, 1000), EPERM, "runs as uid 65534");
  Arrivals seen;
  ASSERT_EQ(::read(report[0], &seen, sizeof seen), static_cast<ssize_t>(sizeof seen));
  EXPECT_EQ(wait_exit(child, 5000), 0);
  EXPECT_EQ(seen.connections, 1);  // it got as far as a connection...
  EXPECT_EQ(seen.bytes, 0);        // ...and not one byte
  EXPECT_EQ(seen.fds, 0);          // nor one fd
  ::close(ready[0]);
  ::close(report[0]);
}

TEST_F(ListenerTrust, RefusesAnAbstractNamespacePathAndNeverConnects) {
  const std::string name = std::string("\0kvshare-attack-", 16) + std::to_string(::getpid());
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, name.data(), name.size());
  const int listener = listen_at(address, static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size()));
  ASSERT_GE(listener, 0) << std::strerror(errno);
  auto decoder = exporting_decoder();
  expect_refusal(decoder.share(name, 0, 1000), EPERM, "abstract namespace");
  const Arrivals seen = accept_and_drain(listener, 50);
  EXPECT_EQ(seen.connections, 0);
  EXPECT_EQ(seen.fds, 0);
  ::close(listener);
}

TEST_F(ListenerTrust, ShowsTheNulOfAnAbstractPathInItsMessage) {
  auto decoder = exporting_decoder();
  auto refused = decoder.share(std::string("\0evil", 5), 0, 1000);
  ASSERT_FALSE(refused);
  EXPECT_THAT(refused.error().message(), HasSubstr("\"\\0evil\""));
}

TEST_F(ListenerTrust, RefusesASymlinkToTheBrokersSocket) {
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  SharedTmpDir elsewhere;
  const std::string link = elsewhere / "share.sock";
  ASSERT_EQ(::symlink(broker->socket_path().c_str(), link.c_str()), 0);
  auto decoder = exporting_decoder();
  expect_refusal(decoder.share(link, 0, 1000), EPERM, "is a symbolic link");
  auto nothing = broker->receive(100);
  ASSERT_FALSE(nothing);
  EXPECT_EQ(nothing.error().errno_value(), ETIMEDOUT);
  EXPECT_THAT(nothing.error().message(), HasSubstr("nobody connected"));
}

TEST_F(ListenerTrust, RefusesASocketReachedThroughASymlinkedDirectory) {
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  SharedTmpDir elsewhere;
  const std::string linked_dir = elsewhere / "dir";
  ASSERT_EQ(::symlink(broker->directory().c_str(), linked_dir.c_str()), 0);
  auto decoder = exporting_decoder();
  expect_refusal(decoder.share(linked_dir + "/share.sock", 0, 1000), EPERM, "is a symbolic link");
  auto nothing = broker->receive(100);
  ASSERT_FALSE(nothing);
  EXPECT_EQ(nothing.error().errno_value(), ETIMEDOUT);
}

TEST_F(ListenerTrust, RefusesAWorldWritableDirectory) {
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  ASSERT_EQ(::chmod(broker->directory().c_str(), 01777), 0);
  auto decoder = exporting_decoder();
  expect_refusal(decoder.share(broker->socket_path(), 0, 1000), EPERM, "has mode 1777: group or others can reach");
  auto nothing = broker->receive(100);
  ASSERT_FALSE(nothing);
  EXPECT_THAT(nothing.error().message(), HasSubstr("nobody connected"));
}

TEST_F(ListenerTrust, RefusesADirectoryOnlyGroupReadable) {
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  ASSERT_EQ(::chmod(broker->directory().c_str(), 0750), 0);
  auto decoder = exporting_decoder();
  expect_refusal(decoder.share(broker->socket_path(), 0, 1000), EPERM, "has mode 0750");
}

TEST_F(ListenerTrust, RefusesADirectoryOwnedByAnotherUid) {
  KVSHARE_NEED_ROOT();
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  ASSERT_EQ(::chown(broker->directory().c_str(), kNobodyUid, kNobodyGid), 0);
  auto decoder = exporting_decoder();
  expect_refusal(decoder.share(broker->socket_path(), 0, 1000), EPERM, "is owned by uid 65534");
  auto nothing = broker->receive(100);
  ASSERT_FALSE(nothing);
  EXPECT_THAT(nothing.error().message(), HasSubstr("nobody connected"));
}

TEST_F(ListenerTrust, RefusesARelativePath) {
  auto decoder = exporting_decoder();
  expect_refusal(decoder.share("share.sock", 0, 1000), EPERM, "the path is relative");
}

TEST_F(ListenerTrust, RefusesAPathThatIsNotASocket) {
  SharedTmpDir ours;
  const std::string file = ours / "share.sock";
  kvshare::testing::write_file_bytes(file, {});
  auto decoder = exporting_decoder();
  expect_refusal(decoder.share(file, 0, 1000), ENOTSOCK, "is a regular file, not a socket");
}

TEST_F(ListenerTrust, ADecoderThatCannotExportSendsEvenItsRefusalOnlyToACheckedListener) {
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  ASSERT_EQ(::chmod(broker->directory().c_str(), 0777), 0);
  auto decoder = DecoderShare::start(kvshare::testing::small_share_header(), false, memfd_only());
  expect_refusal(decoder.share(broker->socket_path(), 0, 1000), ENOTSUP, "cannot share its KV cache");
  auto nothing = broker->receive(100);
  ASSERT_FALSE(nothing);
  EXPECT_THAT(nothing.error().message(), HasSubstr("nobody connected"));
}

TEST_F(ListenerTrust, MapsARefusedListenerToHttp403) {
  auto decoder = exporting_decoder();
  auto refused = decoder.share("relative.sock", 0, 1000);
  ASSERT_FALSE(refused);
  EXPECT_EQ(http_status_for(refused.error()), 403);
}

}  // namespace
}  // namespace kvshare::security
