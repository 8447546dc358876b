#include "kvshare/handshake/listener.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "support/test_support.h"

namespace kvshare::handshake {
namespace {

using testing::FdLeakCheck;
namespace fs = std::filesystem;

class HandshakeListener : public FdLeakCheck {};

TEST_F(HandshakeListener, ListensInAPrivateDirectoryAndRemovesItOnDestruction) {
  testing::TempDir parent;
  fs::path directory;
  std::string socket_path;
  {
    auto listener = Listener::create(parent.path());
    ASSERT_TRUE(listener) << listener.error().what();
    directory = listener->directory();
    socket_path = listener->socket_path();
    struct stat st {};
    ASSERT_EQ(::stat(directory.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0700u);
    ASSERT_EQ(::lstat(socket_path.c_str(), &st), 0);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    EXPECT_EQ(fs::path(socket_path).parent_path(), directory);
  }
  EXPECT_FALSE(fs::exists(socket_path));
  EXPECT_FALSE(fs::exists(directory));
}

// kvshare-serve binds one socket per request in its own slot directory: no directory is
// made and removed per request (its rmdir's cost: docs/hybrid.md, "What it costs").
TEST_F(HandshakeListener, ListensInTheCallersPrivateDirectoryAndLeavesIt) {
  testing::TempDir parent;
  const fs::path directory = parent / "serve";
  ASSERT_EQ(::mkdir(directory.c_str(), 0700), 0);
  std::string socket_path;
  {
    auto listener = Listener::create_in(directory, "kvshare-share-7.sock");
    ASSERT_TRUE(listener) << listener.error().what();
    socket_path = listener->socket_path();
    EXPECT_EQ(socket_path, (directory / "kvshare-share-7.sock").string());
    EXPECT_EQ(listener->directory(), directory);
    // A peer checks this socket as it checks the broker's own: it passes.
    auto client = connect_checked_listener(socket_path, 1000);
    ASSERT_TRUE(client) << client.error().what();
    ASSERT_TRUE(listener->accept(1000));
  }
  EXPECT_FALSE(fs::exists(socket_path));
  EXPECT_TRUE(fs::is_directory(directory));
  EXPECT_TRUE(fs::is_empty(directory));
}

TEST_F(HandshakeListener, RefusesACallersDirectoryOthersCanReachOrALinkOrAPathAsName) {
  testing::TempDir parent;
  const fs::path open_dir = parent / "open";
  ASSERT_EQ(::mkdir(open_dir.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(open_dir.c_str(), 0755), 0);
  auto reachable = Listener::create_in(open_dir, "a.sock");
  ASSERT_FALSE(reachable);
  EXPECT_EQ(reachable.error().errno_value(), EPERM);
  EXPECT_NE(reachable.error().message().find("has mode 0755"), std::string::npos) << reachable.error().what();
  EXPECT_TRUE(fs::is_empty(open_dir));

  const fs::path private_dir = parent / "private", link = parent / "link";
  ASSERT_EQ(::mkdir(private_dir.c_str(), 0700), 0);
  fs::create_directory_symlink(private_dir, link);
  auto linked = Listener::create_in(link, "a.sock");
  ASSERT_FALSE(linked);
  EXPECT_NE(linked.error().message().find("is a symbolic link"), std::string::npos) << linked.error().what();

  for (const char* name : {"", "sub/a.sock", "..", "."}) {
    auto bad = Listener::create_in(private_dir, name);
    ASSERT_FALSE(bad) << name;
    EXPECT_EQ(bad.error().errno_value(), EINVAL) << name;
  }
  EXPECT_TRUE(fs::is_empty(private_dir));
}

// A name already taken is refused, and the refused listener does not unlink what is there.
TEST_F(HandshakeListener, LeavesAnExistingSocketOfTheSameNameAlone) {
  testing::TempDir parent;
  const fs::path directory = parent / "serve";
  ASSERT_EQ(::mkdir(directory.c_str(), 0700), 0);
  auto first = Listener::create_in(directory, "kvshare-share-1.sock");
  ASSERT_TRUE(first) << first.error().what();
  {
    auto second = Listener::create_in(directory, "kvshare-share-1.sock");
    ASSERT_FALSE(second);
    EXPECT_EQ(second.error().errno_value(), EADDRINUSE);
  }
  EXPECT_TRUE(fs::exists(first->socket_path()));
  EXPECT_TRUE(connect_checked_listener(first->socket_path(), 1000));
}

TEST_F(HandshakeListener, TimesOutWhenNobodyConnects) {
  auto listener = Listener::create();
  ASSERT_TRUE(listener) << listener.error().what();
  auto connection = listener->accept(30);
  ASSERT_FALSE(connection);
  EXPECT_EQ(connection.error().errno_value(), ETIMEDOUT);
  EXPECT_NE(connection.error().message().find("waiting 30 ms for the decoder to connect"), std::string::npos);
}

TEST_F(HandshakeListener, ReceivesAMessageFromAPeerOfTheSameUid) {
  auto listener = Listener::create();
  ASSERT_TRUE(listener) << listener.error().what();
  auto client = connect_unix(listener->socket_path(), 1000);
  ASSERT_TRUE(client) << client.error().what();
  ASSERT_TRUE(send_message(client->get(), make_refusal(0, "", "this decoder cannot export"), {}, 1000));
  PeerCredentials peer;
  auto received = listener->accept_and_receive(1000, &peer);
  ASSERT_TRUE(received) << received.error().what();
  EXPECT_EQ(peer.pid, ::getpid());
  EXPECT_EQ(received->message.type, MessageType::refuse);
  EXPECT_EQ(received->message.reason, "this decoder cannot export");
}

TEST_F(HandshakeListener, ConnectNamesAMissingSocket) {
  testing::TempDir dir;
  auto client = connect_unix((dir / "nobody.sock").string(), 100);
  ASSERT_FALSE(client);
  EXPECT_EQ(client.error().errno_value(), ENOENT);
  EXPECT_NE(client.error().message().find("nobody.sock"), std::string::npos);
}

TEST(HandshakePeer, AllowsTheSameUidAndRootOnly) {
  EXPECT_TRUE(check_peer_allowed({10, 1000, 1000}, 1000));
  EXPECT_TRUE(check_peer_allowed({10, 0, 0}, 1000));
  auto refused = check_peer_allowed({4121, 65534, 65534}, 1000);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().errno_value(), EPERM);
  EXPECT_NE(refused.error().message().find("pid 4121: peer runs as uid 65534, only uid 1000 or root"),
            std::string::npos);
}

TEST_F(HandshakeListener, RefusesAPeerOfAnotherUid) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a peer as another uid (setuid 65534)";
  auto listener = Listener::create();
  ASSERT_TRUE(listener) << listener.error().what();
  // The directory is 0700, which already keeps other uids out; open it for this test so
  // the SO_PEERCRED check itself is what refuses the peer.
  ASSERT_EQ(::chmod(listener->directory().c_str(), 0755), 0);
  ASSERT_EQ(::chmod(listener->socket_path().c_str(), 0777), 0);
  const std::string path = listener->socket_path();
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(10);
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) ::_exit(11);
    char byte;
    (void)::read(fd, &byte, 1);  // until the listener closes us
    ::_exit(0);
  }
  auto connection = listener->accept(2000);
  int status = 0;
  ASSERT_FALSE(connection);
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  EXPECT_EQ(connection.error().errno_value(), EPERM);
  EXPECT_NE(connection.error().message().find(fmt::format("pid {}: peer runs as uid 65534", child)), std::string::npos)
      << connection.error().message();
}

}  // namespace
}  // namespace kvshare::handshake
