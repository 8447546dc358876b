#include "kvshare/handshake/transport.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "kvshare/sys.h"
#include "support/test_support.h"

namespace kvshare::handshake {
namespace {

using testing::FdLeakCheck;

struct SocketPair {
  Fd sender, receiver;
  SocketPair() {
    int ends[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ends), 0);
    sender.reset(ends[0]);
    receiver.reset(ends[1]);
  }
};

Fd memfd_of(uint64_t size_bytes) {
  Fd fd(::memfd_create("transport-test", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  EXPECT_EQ(::ftruncate(fd.get(), static_cast<off_t>(size_bytes)), 0);
  EXPECT_EQ(::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  return fd;
}

Message share_with(size_t n_fds) {
  Message message;
  message.share_id = 11;
  for (size_t i = 0; i < n_fds; ++i) message.fds.push_back({static_cast<uint32_t>(i), "memfd", 0, 4096, 0x42 + i});
  message.header_json = R"({"format_version":1})";
  return message;
}

// Sends raw bytes with fds attached to the first sendmsg, bypassing send_message's checks,
// as a misbehaving peer would.
void raw_send(int socket_fd, std::string_view bytes, std::span<const int> fds) {
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) unsigned char control[CMSG_SPACE(sizeof(int) * 8)] = {};
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
  }
  ASSERT_EQ(::sendmsg(socket_fd, &msg, MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
}

std::string frame_text(std::string_view json) {
  std::string frame(4, '\0');
  const uint32_t length = static_cast<uint32_t>(json.size());
  for (int i = 0; i < 4; ++i) frame[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  return frame + std::string(json);
}

void expect_error(const Result<ReceivedMessage>& received, int errno_value, const std::string& words) {
  ASSERT_FALSE(received);
  EXPECT_EQ(received.error().errno_value(), errno_value) << received.error().message();
  EXPECT_NE(received.error().message().find(words), std::string::npos) << received.error().message();
}

class HandshakeTransport : public FdLeakCheck {};

TEST_F(HandshakeTransport, DeliversFdsThatMapTheSenderPages) {
  SocketPair pair;
  Fd a = memfd_of(4096), b = memfd_of(4096);
  ASSERT_EQ(::pwrite(b.get(), "kv", 2, 100), 2);
  const int fds[] = {a.get(), b.get()};
  ASSERT_TRUE(send_message(pair.sender.get(), share_with(2), fds, 1000));
  auto received = receive_message(pair.receiver.get(), 1000, "test peer");
  ASSERT_TRUE(received) << received.error().what();
  ASSERT_EQ(received->fds.size(), 2u);
  EXPECT_EQ(received->message.share_id, 11u);
  char bytes[2];
  ASSERT_EQ(::pread(received->fds[1].get(), bytes, 2, 100), 2);
  EXPECT_EQ(std::string(bytes, 2), "kv");
  // MSG_CMSG_CLOEXEC: nothing received leaks into a child.
  EXPECT_TRUE(::fcntl(received->fds[0].get(), F_GETFD) & FD_CLOEXEC);
}

TEST_F(HandshakeTransport, ClosesEveryReceivedFdWhenJsonIsMalformed) {
  SocketPair pair;
  Fd a = memfd_of(4096), b = memfd_of(4096);
  const int fds[] = {a.get(), b.get()};
  raw_send(pair.sender.get(), frame_text(R"({"kvshare_handshake":1,"type":)"), fds);
  expect_error(receive_message(pair.receiver.get(), 1000, "pid 9"), EINVAL,
               "handshake from pid 9: message is not valid JSON");
}

TEST_F(HandshakeTransport, RefusesMoreFdsThanTheMessageDeclares) {
  SocketPair pair;
  Fd a = memfd_of(4096), b = memfd_of(4096), c = memfd_of(4096);
  const int fds[] = {a.get(), b.get(), c.get()};
  raw_send(pair.sender.get(), frame_text(encode_json(share_with(2))), fds);
  expect_error(receive_message(pair.receiver.get(), 1000, "pid 9"), EPROTO, "3 fds received, the message declares 2");
}

TEST_F(HandshakeTransport, RefusesFewerFdsThanTheMessageDeclares) {
  SocketPair pair;
  Fd a = memfd_of(4096);
  const int fds[] = {a.get()};
  raw_send(pair.sender.get(), frame_text(encode_json(share_with(2))), fds);
  expect_error(receive_message(pair.receiver.get(), 1000, "pid 9"), EPROTO, "declares 2 fds, 1 arrived");
}

TEST_F(HandshakeTransport, RefusesARefusalThatCarriesFds) {
  SocketPair pair;
  Fd a = memfd_of(4096);
  const int fds[] = {a.get()};
  raw_send(pair.sender.get(), frame_text(encode_json(make_refusal(1, "", "no export"))), fds);
  expect_error(receive_message(pair.receiver.get(), 1000, "pid 9"), EPROTO, "1 fds received, the message declares 0");
}

TEST_F(HandshakeTransport, RefusesALengthOverTheCapWithoutReadingTheBody) {
  SocketPair pair;
  Fd a = memfd_of(4096);
  const int fds[] = {a.get()};
  raw_send(pair.sender.get(), std::string("\x01\x00\x10\x00", 4), fds);  // 0x100001
  expect_error(receive_message(pair.receiver.get(), 1000, "pid 9"), EMSGSIZE,
               "length prefix says 1048577 bytes, the limit is 1048576");
}

TEST_F(HandshakeTransport, ReportsAShortReadWithTheOffsetReached) {
  SocketPair pair;
  Fd a = memfd_of(4096);
  const int fds[] = {a.get()};
  const std::string frame = frame_text(encode_json(share_with(1)));
  raw_send(pair.sender.get(), frame.substr(0, 20), fds);
  pair.sender.reset();
  expect_error(receive_message(pair.receiver.get(), 1000, "pid 9"), EPROTO,
               fmt::format("peer closed the socket at byte 20 of {}", frame.size()));
}

TEST_F(HandshakeTransport, ReportsAPeerThatClosedBeforeTheLength) {
  SocketPair pair;
  pair.sender.reset();
  expect_error(receive_message(pair.receiver.get(), 1000, "pid 9"), EPROTO, "at byte 0 of the length prefix");
}

TEST_F(HandshakeTransport, RefusesFdsThatArriveAfterTheFirstBytes) {
  SocketPair pair;
  Fd a = memfd_of(4096);
  const int fds[] = {a.get()};
  const std::string frame = frame_text(encode_json(share_with(1)));
  raw_send(pair.sender.get(), frame.substr(0, 4), {});
  raw_send(pair.sender.get(), frame.substr(4), fds);
  expect_error(receive_message(pair.receiver.get(), 1000, "pid 9"), EPROTO, "1 fds arrived at byte 4");
}

TEST_F(HandshakeTransport, TimesOutInsteadOfHanging) {
  SocketPair pair;
  expect_error(receive_message(pair.receiver.get(), 50, "pid 9"), ETIMEDOUT, "0 of ? bytes read");
}

// The seam: MSG_CTRUNC reported by recvmsg closes the fds that did arrive.
TEST_F(HandshakeTransport, ClosesFdsWhenControlDataIsTruncated) {
  SocketPair pair;
  Fd a = memfd_of(4096);
  const int fds[] = {a.get()};
  ASSERT_TRUE(send_message(pair.sender.get(), share_with(1), fds, 1000));
  sys::Ops ops = sys::real_ops();
  ops.recvmsg = [](int fd, msghdr* msg, int flags) -> ssize_t {
    const ssize_t n = sys::real_ops().recvmsg(fd, msg, flags);
    if (n > 0) msg->msg_flags |= MSG_CTRUNC;
    return n;
  };
  sys::ScopedOverride override(ops);
  expect_error(receive_message(pair.receiver.get(), 1000, "pid 9"), EPROTO,
               "control data truncated (MSG_CTRUNC), 1 fds closed");
}

struct Counters {
  static inline int eintr_left = 0;
  static inline int calls = 0;
};

TEST_F(HandshakeTransport, RetriesRecvmsgInterruptedBySignals) {
  SocketPair pair;
  Fd a = memfd_of(4096);
  const int fds[] = {a.get()};
  ASSERT_TRUE(send_message(pair.sender.get(), share_with(1), fds, 1000));
  Counters::eintr_left = 3;
  Counters::calls = 0;
  sys::Ops ops = sys::real_ops();
  ops.recvmsg = [](int fd, msghdr* msg, int flags) -> ssize_t {
    ++Counters::calls;
    if (Counters::eintr_left > 0) return --Counters::eintr_left, errno = EINTR, -1;
    return sys::real_ops().recvmsg(fd, msg, flags);
  };
  sys::ScopedOverride override(ops);
  auto received = receive_message(pair.receiver.get(), 1000, "pid 9");
  ASSERT_TRUE(received) << received.error().what();
  EXPECT_EQ(received->fds.size(), 1u);
  EXPECT_EQ(Counters::calls, 3 + 2);  // three interrupted, then the length and the body
}

TEST_F(HandshakeTransport, ResumesShortSendsWithTheFdsOnTheFirst) {
  SocketPair pair;
  Fd a = memfd_of(4096), b = memfd_of(4096);
  const int fds[] = {a.get(), b.get()};
  Counters::calls = 0;
  sys::Ops ops = sys::real_ops();
  ops.sendmsg = [](int fd, const msghdr* msg, int flags) -> ssize_t {
    ++Counters::calls;
    msghdr shorter = *msg;
    iovec iov = msg->msg_iov[0];
    iov.iov_len = std::min<size_t>(iov.iov_len, 7);
    shorter.msg_iov = &iov;
    return sys::real_ops().sendmsg(fd, &shorter, flags);
  };
  {
    sys::ScopedOverride override(ops);
    ASSERT_TRUE(send_message(pair.sender.get(), share_with(2), fds, 1000));
  }
  EXPECT_GT(Counters::calls, 10);
  auto received = receive_message(pair.receiver.get(), 1000, "pid 9");
  ASSERT_TRUE(received) << received.error().what();
  EXPECT_EQ(received->fds.size(), 2u);
}

TEST_F(HandshakeTransport, RefusesToSendAFdCountThatDiffersFromTheMessage) {
  SocketPair pair;
  Fd a = memfd_of(4096);
  const int fds[] = {a.get()};
  auto sent = send_message(pair.sender.get(), share_with(2), fds, 1000);
  ASSERT_FALSE(sent);
  EXPECT_EQ(sent.error().errno_value(), EINVAL);
  EXPECT_NE(sent.error().message().find("declares 2 fds, 1 given"), std::string::npos);
}

TEST_F(HandshakeTransport, ReportsEpipeWhenThePeerHasGone) {
  SocketPair pair;
  pair.receiver.reset();
  auto sent = send_message(pair.sender.get(), make_refusal(1, "", "gone"), {}, 1000);
  ASSERT_FALSE(sent);
  EXPECT_EQ(sent.error().errno_value(), EPIPE);
}

}  // namespace
}  // namespace kvshare::handshake
