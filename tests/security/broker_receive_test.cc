// The receiving side under attack: what reaches ShareBroker::receive from a connector that
// is not a well-behaved decoder. Each case asserts the refusal, its words, and that no fd
// stays open in this process (the fixture compares /proc/self/fd before and after).
#include <fcntl.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gmock/gmock.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <set>
#include <thread>

#include "attack_support.h"
#include "kvshare/handshake/transport.h"
#include "kvshare/share/broker.h"
#include "kvshare/share/decoder_share.h"
#include "kvshare/share/share_fixtures.h"
#include "support/test_support.h"

namespace kvshare::security {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

ExportOptions memfd_only() {
  ExportOptions options;
  options.forced = RegionBackend::memfd;
  return options;
}

// A real decoder's share message, for an attacker to send with other fds.
struct Decoder {
  DecoderShare share = DecoderShare::start(kvshare::testing::small_share_header(), true, memfd_only());
  handshake::Message message(uint64_t share_id = 1) const {
    handshake::Message m;
    m.share_id = share_id;
    m.header_json = layout::to_json(share.header(), false);
    for (const auto& region : share.regions())
      m.fds.push_back({region.chunk, std::string(region_backend_name(region.backend)), region.offset, region.size_bytes,
                       region.layout_hash});
    return m;
  }
  std::vector<int> fds() const {
    std::vector<int> out;
    for (const auto& region : share.regions()) out.push_back(region.fd.get());
    return out;
  }
  uint64_t chunk_bytes() const { return share.regions().front().size_bytes; }
};

Fd connect_to(const ShareBroker& broker) {
  auto connection = handshake::connect_unix(broker.socket_path(), 1000);
  EXPECT_TRUE(connection) << connection.error().what();
  return connection ? std::move(*connection) : Fd();
}

void expect_refused(const Result<ReceivedShare>& share, int errno_value, const std::string& words) {
  ASSERT_FALSE(share) << "the broker accepted it";
  EXPECT_EQ(share.error().errno_value(), errno_value) << share.error().what();
  EXPECT_THAT(share.error().message(), HasSubstr(words));
}

Fd sealed_memfd(uint64_t size_bytes, int seals) {
  Fd fd(::memfd_create("kvshare-attack", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  EXPECT_TRUE(fd);
  EXPECT_EQ(::ftruncate(fd.get(), static_cast<off_t>(size_bytes)), 0);
  if (seals != 0) {
    EXPECT_EQ(::fcntl(fd.get(), F_ADD_SEALS, seals), 0);
  }
  return fd;
}

class BrokerReceive : public kvshare::testing::FdLeakCheck {
 protected:
  // Sends the decoder's message with `bad` in place of its first fd.
  Result<ReceivedShare> receive_with_first_fd(int bad) {
    auto broker = ShareBroker::listen();
    EXPECT_TRUE(broker);
    Fd connection = connect_to(*broker);
    std::vector<int> fds = decoder.fds();
    fds.front() = bad;
    auto sent = handshake::send_message(connection.get(), decoder.message(), fds, 1000);
    EXPECT_TRUE(sent) << sent.error().what();
    return broker->receive(2000);
  }
  Decoder decoder;
};

TEST_F(BrokerReceive, RefusesAPipe) {
  int ends[2];
  ASSERT_EQ(::pipe2(ends, O_CLOEXEC), 0);
  Fd read_end(ends[0]), write_end(ends[1]);
  expect_refused(receive_with_first_fd(read_end.get()), EINVAL,
                 "is neither a sealed memfd nor a dma-buf (it is \"pipe:");
}

TEST_F(BrokerReceive, RefusesASocket) {
  int ends[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ends), 0);
  Fd a(ends[0]), b(ends[1]);
  expect_refused(receive_with_first_fd(a.get()), EINVAL, "is neither a sealed memfd nor a dma-buf (it is \"socket:");
}

TEST_F(BrokerReceive, RefusesARegularFile) {
  kvshare::testing::TempDir dir;
  Fd file(::open((dir / "kv.bin").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  ASSERT_TRUE(file);
  ASSERT_EQ(::ftruncate(file.get(), static_cast<off_t>(decoder.chunk_bytes())), 0);
  expect_refused(receive_with_first_fd(file.get()), EINVAL, "is neither a sealed memfd nor a dma-buf");
}

TEST_F(BrokerReceive, RefusesAnUnsealedMemfd) {
  Fd memfd = sealed_memfd(decoder.chunk_bytes(), 0);
  expect_refused(receive_with_first_fd(memfd.get()), EINVAL,
                 "(chunk 0): memfd is not sealed against shrinking (seals 0x0)");
}

TEST_F(BrokerReceive, RefusesAMemfdSealedButStillWritableAndShrinkable) {
  Fd memfd = sealed_memfd(decoder.chunk_bytes(), F_SEAL_GROW);
  expect_refused(receive_with_first_fd(memfd.get()), EINVAL, "memfd is not sealed against shrinking (seals 0x4)");
}

TEST_F(BrokerReceive, RefusesAMemfdSmallerThanItsChunk) {
  Fd memfd = sealed_memfd(4096, F_SEAL_SHRINK);
  expect_refused(receive_with_first_fd(memfd.get()), EINVAL,
                 fmt::format("memfd is 4096 bytes, the layout needs {}", decoder.chunk_bytes()));
}

TEST_F(BrokerReceive, RefusesADmaBufSmallerThanItsChunk) {
  ExportOptions heap;
  heap.forced = RegionBackend::dma_heap;
  auto small = DecoderShare::start(kvshare::testing::small_share_header(16), true, heap);
  if (!small.can_share()) GTEST_SKIP() << "no dma-buf heap here: " << small.startup_warning();
  ASSERT_LT(small.regions().front().size_bytes, decoder.chunk_bytes());
  expect_refused(receive_with_first_fd(small.regions().front().fd.get()), EINVAL, "dma-buf is");
}

TEST_F(BrokerReceive, AcceptsAFrameSplitIntoOneByteSends) {
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  Fd connection = connect_to(*broker);
  auto frame = handshake::encode_frame(decoder.message());
  ASSERT_TRUE(frame);
  // The fds ride with the first byte, as send_message puts them; then one byte per send.
  const std::vector<int> fds = decoder.fds();
  for (size_t i = 0; i < frame->size(); ++i)
    ASSERT_EQ(send_raw(connection.get(), frame->data() + i, 1, fds.data(), i == 0 ? fds.size() : 0), 1);
  auto share = broker->receive(2000);
  ASSERT_TRUE(share) << share.error().what();
  EXPECT_EQ(share->fds.size(), decoder.fds().size());
}

TEST_F(BrokerReceive, RefusesFdsThatArriveAfterTheFirstByte) {
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  Fd connection = connect_to(*broker);
  auto frame = handshake::encode_frame(decoder.message());
  ASSERT_TRUE(frame);
  ASSERT_EQ(::send(connection.get(), frame->data(), 1, MSG_NOSIGNAL), 1);
  // Wait until the broker has read byte 0 alone (nothing left unread in our send queue):
  // a reader that came later would take both sends in one recvmsg, fds and all.
  int ioctl_rc = 0;
  int unread = -1;
  const bool read_alone = kvshare::testing::wait_until([&] {
    ioctl_rc = ::ioctl(connection.get(), SIOCOUTQ, &unread);
    return ioctl_rc != 0 || unread == 0;
  });
  ASSERT_EQ(ioctl_rc, 0);
  ASSERT_TRUE(read_alone) << "the broker never read byte 0: " << unread << " bytes unread on fd " << connection.get();
  const std::vector<int> fds = decoder.fds();
  ASSERT_GT(send_raw(connection.get(), frame->data() + 1, frame->size() - 1, fds.data(), fds.size()), 0);
  expect_refused(broker->receive(2000), EPROTO, "not with the first bytes; all closed");
}

TEST_F(BrokerReceive, ClosesTheFdsOfAPeerThatVanishesMidFrame) {
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  {
    Fd connection = connect_to(*broker);
    auto frame = handshake::encode_frame(decoder.message());
    ASSERT_TRUE(frame);
    const std::vector<int> fds = decoder.fds();
    ASSERT_EQ(send_raw(connection.get(), frame->data(), 10, fds.data(), fds.size()), 10);
  }  // gone
  expect_refused(broker->receive(2000), EPROTO, "short read: peer closed the socket at byte 10");
}

TEST_F(BrokerReceive, RefusesScmMaxFdFdsWhenTheMessageDeclaresFewer) {
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  Fd connection = connect_to(*broker);
  std::vector<int> many(handshake::kMaxFds, decoder.fds().front());
  // send_message checks the count against the message; the attacker does not use it.
  auto frame = handshake::encode_frame(decoder.message());
  ASSERT_TRUE(frame);
  ASSERT_EQ(send_raw(connection.get(), frame->data(), frame->size(), many.data(), many.size()),
            static_cast<ssize_t>(frame->size()));
  expect_refused(broker->receive(2000), EPROTO,
                 fmt::format("253 fds received, the message declares {}; all closed", decoder.fds().size()));
}

TEST_F(BrokerReceive, SendsNothingPastScmMaxFd) {
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  Fd connection = connect_to(*broker);
  handshake::Message message = decoder.message();
  message.fds.resize(handshake::kMaxFds + 1, message.fds.front());
  std::vector<int> many(handshake::kMaxFds + 1, decoder.fds().front());
  auto sent = handshake::send_message(connection.get(), message, many, 1000);
  ASSERT_FALSE(sent);
  EXPECT_EQ(sent.error().errno_value(), EINVAL);
  EXPECT_THAT(sent.error().message(), HasSubstr("cannot send 254 fds in one message, the limit is 253"));
  connection.reset();
  expect_refused(broker->receive(2000), EPROTO, "peer closed the socket at byte 0");
}

TEST_F(BrokerReceive, RefusesControlDataTruncatedWhenItsFdTableIsFull) {
  // The kernel truncates SCM_RIGHTS (MSG_CTRUNC) when the receiver cannot install every
  // fd; a peer can force that by sending more fds than we have room for.
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  const size_t fds_before = kvshare::testing::open_fds().size();
  Fd connection = connect_to(*broker);
  // The count below must hold the broker's end of the connection too: wait for its accept
  // (ours and the broker's, two more fds), however late its thread runs.
  ASSERT_TRUE(kvshare::testing::wait_until([&] { return kvshare::testing::open_fds().size() >= fds_before + 2; }))
      << "the broker never accepted";
  // The fd numbers below the limit that are still free: send more fds than that.
  const std::set<int> open_now = kvshare::testing::open_fds();
  const int limit = *open_now.rbegin() + 3;
  const size_t free_slots = static_cast<size_t>(limit) - open_now.size();
  if (free_slots + 5 > handshake::kMaxFds) GTEST_SKIP() << free_slots << " free fd slots: too many to fill";
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  std::vector<int> many(free_slots + 5, decoder.fds().front());
  handshake::Message message = decoder.message();
  message.fds.resize(many.size(), message.fds.front());
  rlimit tight = saved;
  tight.rlim_cur = static_cast<rlim_t>(limit);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &tight), 0);
  auto sent = handshake::send_message(connection.get(), message, many, 1000);
  auto share = broker->receive(2000);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &saved), 0);
  ASSERT_TRUE(sent) << sent.error().what();
  expect_refused(share, EPROTO, "control data truncated (MSG_CTRUNC)");
}

TEST_F(BrokerReceive, RefusesALengthPrefixPastTheLimitAndClosesItsFds) {
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  Fd connection = connect_to(*broker);
  const uint32_t length = handshake::kMaxMessageBytes + 1;
  unsigned char prefix[4] = {static_cast<unsigned char>(length), static_cast<unsigned char>(length >> 8),
                             static_cast<unsigned char>(length >> 16), static_cast<unsigned char>(length >> 24)};
  const std::vector<int> fds = decoder.fds();
  ASSERT_EQ(send_raw(connection.get(), prefix, sizeof prefix, fds.data(), fds.size()), 4);
  expect_refused(broker->receive(2000), EMSGSIZE, "length prefix says 1048577 bytes, the limit is 1048576");
}

TEST_F(BrokerReceive, GivesUpOnASlowLorisAtItsDeadline) {
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  Fd connection = connect_to(*broker);
  auto frame = handshake::encode_frame(decoder.message());
  ASSERT_TRUE(frame);
  std::atomic<bool> stop{false};
  std::thread loris([&] {
    for (size_t i = 0; i < frame->size() && !stop.load(); ++i) {
      (void)::send(connection.get(), frame->data() + i, 1, MSG_NOSIGNAL);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  const auto start = Clock::now();
  auto share = broker->receive(300);
  const auto waited = Clock::now() - start;
  stop = true;
  loris.join();
  expect_refused(share, ETIMEDOUT, "no share within 300 ms: receiving handshake from pid");
  EXPECT_THAT(share.error().message(), HasSubstr("bytes read"));
  EXPECT_LT(waited, std::chrono::milliseconds(1500));
}

TEST_F(BrokerReceive, RefusesAConnectorOfAnotherUidBeforeReadingAByte) {
  KVSHARE_NEED_ROOT();
  // Opened on purpose, so the stranger gets as far as SO_PEERCRED.
  SharedTmpDir parent(::geteuid(), 0755);
  auto broker = ShareBroker::listen(parent.path());
  ASSERT_TRUE(broker);
  ASSERT_EQ(::chmod(broker->directory().c_str(), 0755), 0);
  ASSERT_EQ(::chmod(broker->socket_path().c_str(), 0777), 0);
  auto frame = handshake::encode_frame(decoder.message());
  ASSERT_TRUE(frame);
  Fd memfd = sealed_memfd(decoder.chunk_bytes(), F_SEAL_SHRINK);
  const sockaddr_un address = unix_address(broker->socket_path());
  const pid_t child = fork_as_nobody([&] {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0) return 3;
    const int passed = memfd.get();
    // The broker may already have closed it (EPIPE): the connect is what got through.
    return send_raw(fd, frame->data(), frame->size(), &passed, 1) > 0 || errno == EPIPE || errno == ECONNRESET ? 0 : 4;
  });
  auto share = broker->receive(3000);
  EXPECT_EQ(wait_exit(child, 3000), 0);
  expect_refused(share, EPERM, "peer runs as uid 65534, only uid 0 or root may share KV");
}

TEST_F(BrokerReceive, AnotherUidCannotReachTheBrokersSocket) {
  KVSHARE_NEED_ROOT();
  SharedTmpDir parent(::geteuid(), 0755);  // the stranger may look in here, not further
  auto broker = ShareBroker::listen(parent.path());
  ASSERT_TRUE(broker);
  const sockaddr_un address = unix_address(broker->socket_path());
  const pid_t child = fork_as_nobody([&] {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    return ::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) == 0 ? 0 : errno;
  });
  EXPECT_EQ(wait_exit(child, 3000), EACCES);  // the 0700 directory stops it at the path
  auto nothing = broker->receive(100);
  expect_refused(nothing, ETIMEDOUT, "nobody connected");
}

TEST_F(BrokerReceive, ReceivesAOneMebibyteHeaderSentBeforeReceiveIsCalled) {
  // Bug pinned: the decoder sends while it answers the share request, the broker only
  // read after that answer; a frame past the socket buffer (about 200 KiB) stalled the
  // decoder until its timeout and the route fell back to the state file every time.
  layout::ShareHeader header = kvshare::testing::small_share_header();
  const size_t base = layout::to_json(header, false).size();
  header.model.name = std::string(handshake::kMaxMessageBytes - base - 4096, 'n');
  auto big = DecoderShare::start(header, true, memfd_only());
  ASSERT_TRUE(big.can_share()) << big.startup_warning();
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  // The route's order: share's HTTP answer first, receive after.
  auto share_id = big.share(broker->socket_path(), 0, 2000);
  ASSERT_TRUE(share_id) << share_id.error().what();
  auto share = broker->receive(2000);
  ASSERT_TRUE(share) << share.error().what();
  EXPECT_EQ(share->header.model.name.size(), header.model.name.size());
  EXPECT_GT(layout::to_json(share->header, false).size(), 1000u * 1024u);
}

TEST_F(BrokerReceive, RefusesAReplayedShareId) {
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  auto id = decoder.share.share(broker->socket_path(), 0, 2000);
  ASSERT_TRUE(id);
  ASSERT_TRUE(broker->receive(2000));
  ASSERT_TRUE(decoder.share.adopt(4, *id));
  auto replay = decoder.share.adopt(4, *id);
  ASSERT_FALSE(replay);
  EXPECT_EQ(replay.error().errno_value(), ESTALE);
  EXPECT_THAT(replay.error().message(), HasSubstr("it was already adopted"));
}

TEST_F(BrokerReceive, RefusesAdoptOfAShareThatAnotherSocketReceived) {
  auto first_broker = ShareBroker::listen();
  auto second_broker = ShareBroker::listen();
  ASSERT_TRUE(first_broker && second_broker);
  auto first = decoder.share.share(first_broker->socket_path(), 0, 2000);
  auto second = decoder.share.share(second_broker->socket_path(), 0, 2000);
  ASSERT_TRUE(first && second);
  ASSERT_TRUE(first_broker->receive(2000));
  ASSERT_TRUE(second_broker->receive(2000));
  auto stale = decoder.share.adopt(4, *first);
  ASSERT_FALSE(stale);
  EXPECT_EQ(stale.error().errno_value(), ESTALE);
  EXPECT_THAT(stale.error().message(), HasSubstr(fmt::format("it is stale, the later share {} of stream 0", *second)));
}

}  // namespace
}  // namespace kvshare::security
