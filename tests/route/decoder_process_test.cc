#include "route/decoder_process.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <thread>

#include "kvshare/fd.h"
#include "support/test_support.h"

namespace kvshare::route {
namespace {

namespace fs = std::filesystem;
using kvshare::testing::TempDir;

void write_script(const fs::path& path, const std::string& text) {
  std::ofstream(path) << text;
  fs::permissions(path, fs::perms::owner_all);
}

// Takes every port the "decoder" is told (it writes it to `port_file`) before the decoder
// can, and answers GET /health with 200 there: the third process of the bind-close-pass race.
class PortSquatter {
 public:
  explicit PortSquatter(fs::path port_file) : port_file_(std::move(port_file)), thread_([this] { run(); }) {}
  ~PortSquatter() {
    stop_ = true;
    thread_.join();
  }
  int ports_taken() const { return ports_taken_; }

 private:
  void run() {
    int current = 0;
    Fd listener;
    while (!stop_) {
      int port = 0;
      std::ifstream(port_file_) >> port;
      if (port > 0 && port != current) {
        listener.reset(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
        int yes = 1;
        ::setsockopt(listener.get(), SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
        sockaddr_in address{};
        address.sin_family = AF_INET;
        address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        address.sin_port = htons(static_cast<uint16_t>(port));
        if (::bind(listener.get(), reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
            ::listen(listener.get(), 16) == 0) {
          current = port;
          ++ports_taken_;
        }
      }
      if (!listener) {
        ::usleep(5000);
        continue;
      }
      pollfd ready{listener.get(), POLLIN, 0};
      if (::poll(&ready, 1, 5) <= 0) continue;
      Fd client(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (!client) continue;
      char request[1024];
      (void)!::read(client.get(), request, sizeof request);
      const std::string reply =
          "HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n"
          "{\"status\":\"ok\"}";
      (void)!::write(client.get(), reply.data(), reply.size());
    }
  }

  fs::path port_file_;
  std::atomic<bool> stop_{false};
  std::atomic<int> ports_taken_{0};
  std::thread thread_;
};

// A decoder process, its pipes, a squatter's sockets: all closed by the end of each test.
// (Not "DecoderProcess": that is the class under test.)
class DecoderProcessTest : public kvshare::testing::FdLeakCheck {};
class LoopbackListenerInode : public kvshare::testing::FdLeakCheck {};

ServeConfig config_in(const TempDir& dir) {
  ServeConfig config;
  config.model = dir / "model.gguf";
  return config;
}

// Regression: serve picked a free port, closed it and passed the number on; whoever took
// the port in between answered /health and was taken for the decoder.
TEST_F(DecoderProcessTest, NeverTakesAnotherProcessOnItsPortForTheDecoder) {
  TempDir dir;
  const auto port_file = dir / "port";
  // A decoder that is slow to bind: it only says which port it was given.
  write_script(dir / "decoder.sh", "#!/bin/sh\nwhile [ $# -gt 0 ]; do\n  if [ \"$1\" = --port ]; then echo \"$2\" > " +
                                       port_file.string() + "; fi\n  shift\ndone\nexec sleep 30\n");
  PortSquatter squatter(port_file);
  Backend backend;
  backend.program = dir / "decoder.sh";
  auto decoder = DecoderProcess::start(config_in(dir), backend, std::chrono::seconds(20), nullptr);
  ASSERT_FALSE(decoder) << "the squatter on port " << (*decoder)->port() << " was taken for the decoder";
  EXPECT_EQ(decoder.error().errno_value(), EADDRINUSE) << decoder.error().what();
  EXPECT_NE(decoder.error().message().find("another process took the decoder's port 3 times"), std::string::npos)
      << decoder.error().what();
  EXPECT_EQ(squatter.ports_taken(), 3);
}

TEST_F(DecoderProcessTest, AcceptsTheDecoderListeningOnItsOwnPort) {
  TempDir dir;
  ServeConfig config = config_in(dir);
  const auto made = kvshare::testing::run_command(kvshare::testing::tool_path("kvshare-mkmodel").string() +
                                                  " --arch llama --seed 3 " + config.model.string());
  ASSERT_EQ(made.exit_code, 0) << "kvshare-mkmodel: " << made.err;
  Backend backend;
  backend.program = kvshare::testing::tool_path("kvshare-decoder");
  auto decoder = DecoderProcess::start(config, backend, std::chrono::seconds(30), nullptr);
  ASSERT_TRUE(decoder) << decoder.error().what();
  auto inode = loopback_listener_inode((*decoder)->port());
  ASSERT_TRUE(inode);
  EXPECT_NE(*inode, 0u);
  const fs::path slot_dir = (*decoder)->slot_dir();
  (*decoder)->stop();
  EXPECT_FALSE(fs::exists(slot_dir));
}

TEST_F(LoopbackListenerInode, IsZeroWhenNothingListens) {
  auto port = pick_free_loopback_port();
  ASSERT_TRUE(port) << port.error().what();
  auto inode = loopback_listener_inode(*port);
  ASSERT_TRUE(inode) << inode.error().what();
  EXPECT_EQ(*inode, 0u);
}

}  // namespace
}  // namespace kvshare::route
