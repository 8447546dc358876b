// A share blocked on a broker that does not accept must not hold up the decoder's other
// share/adopt bookkeeping.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "kvshare/fd.h"
#include "kvshare/share/decoder_share.h"
#include "share_fixtures.h"
#include "support/test_support.h"

namespace kvshare {
namespace {

// The decoder's region, the broker's listener and every connection: closed by the end.
// (Not "DecoderShare": that is the class under test.)
class DecoderShareTest : public testing::FdLeakCheck {};

Fd listen_unix(const std::string& path, int backlog) {
  Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  EXPECT_EQ(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  EXPECT_EQ(::listen(fd.get(), backlog), 0);
  return fd;
}

Fd connect_plain(const std::string& path) {
  Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  EXPECT_EQ(::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  return fd;
}

// Regression: share() held DecoderShare's mutex across connect and send (up to their
// timeouts), so a broker that never accepted stalled every adopt and latest_share_id().
TEST_F(DecoderShareTest, AnswersWhileAShareWaitsForABrokerThatDoesNotAccept) {
  ExportOptions options;
  options.forced = RegionBackend::memfd;
  auto decoder = DecoderShare::start(testing::small_share_header(), true, options);
  ASSERT_TRUE(decoder.can_share()) << decoder.startup_warning();
  testing::TempDir dir;
  const std::string path = (dir / "broker.sock").string();
  Fd listener = listen_unix(path, 0);
  Fd filler = connect_plain(path);  // the backlog of 0 holds this one; the next connect waits
  // The share's connect can only end at its timeout or once the filler is accepted below,
  // so whether adopt answered first is an order, not a time: with the mutex held across
  // connect, latest_share_id() would return only after the share gave up.
  const int share_timeout_ms = static_cast<int>(std::chrono::milliseconds(testing::kLoadedDeadline).count());
  std::atomic<bool> share_returned{false};
  std::thread blocked([&] {
    (void)decoder.share(path, 0, share_timeout_ms);
    share_returned = true;
  });
  // Once the share has its id it is in (or about to enter) the connect that waits.
  EXPECT_TRUE(testing::wait_until([&] { return decoder.latest_share_id() == 1; })) << "the share never took its id";
  auto adopted = decoder.adopt(1, 1);
  EXPECT_FALSE(share_returned) << "latest_share_id() and adopt() answered only after the share gave up";
  EXPECT_TRUE(adopted) << adopted.error().what();
  Fd accepted(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));  // lets the connect through
  EXPECT_TRUE(accepted);
  blocked.join();
}

}  // namespace
}  // namespace kvshare
