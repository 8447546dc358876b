#include "route/upstream_stream.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <thread>

#include "kvshare/fd.h"
#include "support/test_support.h"

namespace kvshare::route {
namespace {

// A one-connection HTTP server on 127.0.0.1 that answers with `body_bytes` bytes as fast
// as the reader takes them (its writes block when the reader stops).
class BulkServer {
 public:
  explicit BulkServer(size_t body_bytes) : body_bytes_(body_bytes) {
    listener_.reset(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof address;
    EXPECT_EQ(::bind(listener_.get(), reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
    EXPECT_EQ(::listen(listener_.get(), 1), 0);
    ::getsockname(listener_.get(), reinterpret_cast<sockaddr*>(&address), &length);
    port_ = ntohs(address.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~BulkServer() { thread_.join(); }
  int port() const { return port_; }

 private:
  void serve() {
    Fd client(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!client) return;
    std::string request;
    char buffer[4096];
    while (request.find("\r\n\r\n") == std::string::npos) {
      const ssize_t got = ::read(client.get(), buffer, sizeof buffer);
      if (got <= 0) return;
      request.append(buffer, static_cast<size_t>(got));
    }
    const std::string head =
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: " + std::to_string(body_bytes_) +
        "\r\nConnection: close\r\n\r\n";
    if (::write(client.get(), head.data(), head.size()) != static_cast<ssize_t>(head.size())) return;
    const std::string piece(64 * 1024, 'x');
    size_t sent = 0;
    while (sent < body_bytes_) {
      const ssize_t n = ::send(client.get(), piece.data(), std::min(piece.size(), body_bytes_ - sent), MSG_NOSIGNAL);
      if (n <= 0) return;
      sent += static_cast<size_t>(n);
    }
  }

  size_t body_bytes_;
  Fd listener_;
  int port_ = 0;
  std::thread thread_;
};

// The stream's connection and the server's listener are the test's own: closed by its end.
// (Not "UpstreamStream": that is the class under test.)
class UpstreamStreamTest : public testing::FdLeakCheck {};

std::shared_ptr<UpstreamStream> get_bulk(const BulkServer& server) {
  UpstreamStream::Request request;
  request.host = "127.0.0.1";
  request.port = server.port();
  request.method = "GET";
  request.path = "/bulk";
  return UpstreamStream::start(std::move(request), nullptr);
}

// Regression: every piece the decoder sent was queued however slowly the client read, so a
// long reply to a stalled client grew serve's memory without limit.
TEST_F(UpstreamStreamTest, StopsReadingTheDecoderWhileTheClientIsBehind) {
  constexpr size_t kBody = 64u << 20;
  BulkServer server(kBody);
  auto stream = get_bulk(server);
  ASSERT_TRUE(stream->wait_head());
  // Nobody calls next(): the call's thread must stop at the bound rather than read on to the
  // end. Waiting for that state, not for a time: a busy machine fills the queue slowly.
  ASSERT_TRUE(stream->wait_for_backpressure()) << "read all " << kBody << " bytes with nobody taking them";
  EXPECT_LE(stream->buffered_bytes(), UpstreamStream::kMaxBufferedBytes + 256 * 1024);
  size_t total = 0;
  std::string piece;
  while (stream->next(piece)) total += piece.size();
  EXPECT_EQ(total, kBody);
  EXPECT_FALSE(stream->transport_error());
}

TEST_F(UpstreamStreamTest, CancelWakesAReaderThatWaitsForRoom) {
  BulkServer server(16u << 20);
  auto stream = get_bulk(server);
  ASSERT_TRUE(stream->wait_head());
  ASSERT_TRUE(stream->wait_for_backpressure());
  // cancel + join: the reader waits for room no one will make, so only the cancel can end
  // it. Without the wake this hangs; the bound is a safety net, not a measurement.
  const auto start = std::chrono::steady_clock::now();
  stream.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - start, testing::kLoadedDeadline);
}

}  // namespace
}  // namespace kvshare::route
