// A share blocked on a broker that does not accept must not hold up the decoder's other
// share/adopt bookkeeping.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "kvshare/fd.h"
#include "kvshare/share/decoder_share.h"
#include "share_fixtures.h"
#include "support/test_support.h"

namespace kvshare {
namespace {

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
TEST(DecoderShare, AnswersWhileAShareWaitsForABrokerThatDoesNotAccept) {
  ExportOptions options;
  options.forced = RegionBackend::memfd;
  auto decoder = DecoderShare::start(testing::small_share_header(), true, options);
  ASSERT_TRUE(decoder.can_share()) << decoder.startup_warning();
  testing::TempDir dir;
  const std::string path = (dir / "broker.sock").string();
  Fd listener = listen_unix(path, 0);
  Fd filler = connect_plain(path);  // the backlog of 0 holds this one; the next connect waits
  std::thread blocked([&] { (void)decoder.share(path, 3000); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto start = std::chrono::steady_clock::now();
  const uint64_t latest = decoder.latest_share_id();
  auto adopted = decoder.adopt(1, latest);
  const auto waited = std::chrono::steady_clock::now() - start;
  blocked.join();
  EXPECT_EQ(latest, 1u);
  EXPECT_TRUE(adopted) << adopted.error().what();
  EXPECT_LT(waited, std::chrono::milliseconds(500));
}

}  // namespace
}  // namespace kvshare
