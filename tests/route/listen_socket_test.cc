#include "route/listen_socket.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>

#include "kvshare/fd.h"
#include "kvshare/sys.h"
#include "support/test_support.h"

namespace kvshare::route {
namespace {

class ListenSocket : public kvshare::testing::FdLeakCheck {};

// Regression: serve ignored what setsockopt(SO_REUSEADDR) and its second listen() returned,
// so a serve left with httplib's backlog of 5, or a port another server could share,
// started as if all was well.
TEST_F(ListenSocket, NamesTheFdAndErrnoWhenTheDeeperBacklogIsRefused) {
  sys::Ops ops = sys::real_ops();
  ops.listen = [](int, int) {
    errno = EADDRINUSE;
    return -1;
  };
  sys::ScopedOverride seam(ops);
  auto deep = deepen_backlog(42);
  ASSERT_FALSE(deep);
  EXPECT_EQ(deep.error().errno_value(), EADDRINUSE);
  EXPECT_NE(deep.error().message().find("listen(fd 42, SOMAXCONN)"), std::string::npos) << deep.error().message();
}

TEST_F(ListenSocket, NamesTheFdAndErrnoWhenSoReuseaddrCannotBeSet) {
  sys::Ops ops = sys::real_ops();
  ops.setsockopt = [](int, int, int, const void*, socklen_t) {
    errno = ENOPROTOOPT;
    return -1;
  };
  sys::ScopedOverride seam(ops);
  auto set = reuse_address(42);
  ASSERT_FALSE(set);
  EXPECT_EQ(set.error().errno_value(), ENOPROTOOPT);
  EXPECT_NE(set.error().message().find("SO_REUSEADDR) on socket fd 42"), std::string::npos) << set.error().message();
}

TEST_F(ListenSocket, SetsReuseaddrAndDeepensTheBacklogOfAListeningSocket) {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(fd);
  ASSERT_TRUE(reuse_address(fd.get()));
  int value = 0;
  socklen_t length = sizeof value;
  ASSERT_EQ(::getsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &value, &length), 0);
  EXPECT_EQ(value, 1);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd.get(), reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
  ASSERT_EQ(::listen(fd.get(), 5), 0);  // as httplib leaves it
  EXPECT_TRUE(deepen_backlog(fd.get()));
}

}  // namespace
}  // namespace kvshare::route
