#include "kvshare/handshake/listener.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "kvshare/sys.h"

namespace kvshare::handshake {
namespace {

std::filesystem::path default_parent() {
  const char* tmpdir = std::getenv("TMPDIR");
  return tmpdir != nullptr && tmpdir[0] != '\0' ? std::filesystem::path(tmpdir) : std::filesystem::path("/tmp");
}

}  // namespace

Result<Listener> Listener::create(const std::filesystem::path& parent) {
  const std::filesystem::path base = parent.empty() ? default_parent() : parent;
  std::string pattern = (base / "kvshare-share-XXXXXX").string();
  // mkdtemp makes the directory 0700: only this uid (and root) can reach the socket.
  if (::mkdtemp(pattern.data()) == nullptr) return fail(errno, "creating the handshake directory {}", pattern);
  Listener listener;
  listener.directory_ = pattern;
  listener.owns_directory_ = true;
  listener.socket_path_ = (listener.directory_ / "share.sock").string();
  if (auto listening = listener.bind_and_listen(); !listening) return fail(listening.error());
  return listener;
}

Result<Listener> Listener::create_in(const std::filesystem::path& private_dir, const std::string& socket_name) {
  if (socket_name.empty() || socket_name.find('/') != std::string::npos || socket_name == "." || socket_name == "..")
    return fail(EINVAL, "handshake socket name \"{}\" is not a plain file name", socket_name);
  if (auto checked =
          check_private_directory(private_dir.string(), ::geteuid(), fmt::format("handshake socket {}", socket_name));
      !checked)
    return fail(checked.error());
  Listener listener;
  listener.directory_ = private_dir;
  listener.socket_path_ = (private_dir / socket_name).string();
  if (auto listening = listener.bind_and_listen(); !listening) return fail(listening.error());
  return listener;
}

Result<void> Listener::bind_and_listen() {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path_.size() >= sizeof addr.sun_path)
    return fail(ENAMETOOLONG, "socket path {} is {} bytes, the limit is {}; use a shorter TMPDIR", socket_path_,
                socket_path_.size(), sizeof addr.sun_path - 1);
  std::memcpy(addr.sun_path, socket_path_.data(), socket_path_.size());
  socket_.reset(sys::ops().socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!socket_) return fail(errno, "socket(AF_UNIX) for {}", socket_path_);
  if (sys::ops().bind(socket_.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    const int error = errno;
    const std::string path = std::exchange(socket_path_, {});  // not ours: the cleanup must not unlink it
    socket_.reset();
    return fail(error, "bind {}", path);
  }
  if (sys::ops().listen(socket_.get(), 4) != 0) return fail(errno, "listen on {}", socket_path_);
  return {};
}

Listener::Listener(Listener&& other) noexcept
    : socket_(std::move(other.socket_)),
      directory_(std::exchange(other.directory_, {})),
      socket_path_(std::exchange(other.socket_path_, {})),
      owns_directory_(std::exchange(other.owns_directory_, false)) {}

Listener& Listener::operator=(Listener&& other) noexcept {
  if (this != &other) {
    cleanup();
    socket_ = std::move(other.socket_);
    directory_ = std::exchange(other.directory_, {});
    socket_path_ = std::exchange(other.socket_path_, {});
    owns_directory_ = std::exchange(other.owns_directory_, false);
  }
  return *this;
}

Listener::~Listener() { cleanup(); }

void Listener::cleanup() noexcept {
  socket_.reset();
  if (!socket_path_.empty()) sys::ops().unlink(socket_path_.c_str());
  if (owns_directory_ && !directory_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(directory_, ec);
  }
  socket_path_.clear();
  directory_.clear();
}

Result<Fd> Listener::accept(int timeout_ms, PeerCredentials* peer_out, int cancel_fd) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    Fd connection(sys::ops().accept4(socket_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (connection) {
      auto peer = peer_credentials(connection.get());
      if (!peer) return fail(peer.error());
      if (auto allowed = check_peer_allowed(*peer, ::geteuid()); !allowed) return fail(allowed.error());
      if (peer_out != nullptr) *peer_out = *peer;
      return connection;
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno != EAGAIN) return fail(errno, "accept on {}", socket_path_);
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
    if (left.count() <= 0)
      return fail(ETIMEDOUT, "waiting {} ms for the decoder to connect to {}", timeout_ms, socket_path_);
    pollfd entries[2] = {{socket_.get(), POLLIN, 0}, {cancel_fd, POLLIN, 0}};
    const int n = sys::ops().poll(entries, cancel_fd >= 0 ? 2 : 1, static_cast<int>(left.count()));
    if (n < 0 && errno != EINTR) return fail(errno, "poll on {}", socket_path_);
    if (n > 0 && cancel_fd >= 0 && entries[1].revents != 0)
      return fail(ECANCELED, "waiting for the decoder to connect to {}: nobody connected", socket_path_);
  }
}

Result<ReceivedMessage> Listener::accept_and_receive(int timeout_ms, PeerCredentials* peer_out,
                                                     std::string_view known_header, int cancel_fd) {
  const auto start = std::chrono::steady_clock::now();
  PeerCredentials peer;
  auto connection = accept(timeout_ms, &peer, cancel_fd);
  if (!connection) return fail(connection.error());
  if (peer_out != nullptr) *peer_out = peer;
  const auto spent = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
  const int left = std::max(0, timeout_ms - static_cast<int>(spent.count()));
  return receive_message(connection->get(), left, fmt::format("pid {}", peer.pid), known_header, cancel_fd);
}

}  // namespace kvshare::handshake
