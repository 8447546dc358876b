#include "kvshare/share/provider_channel.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <climits>

namespace kvshare {
namespace {

int wait_ms(int timeout_ms) { return timeout_ms < 0 ? INT_MAX : timeout_ms; }
// Serve's requests and our replies are small; a send that cannot finish in this long means
// serve stopped reading, and the channel is over.
constexpr int kSendTimeoutMs = 60000;

std::string_view body_of(const handshake::ReceivedFrame& frame) {
  return {reinterpret_cast<const char*>(frame.body.data()), frame.body.size()};
}

std::string serve_name(const handshake::PeerCredentials& peer) {
  return fmt::format("kvshare-serve (pid {})", peer.pid);
}

}  // namespace

Result<ProviderChannel> ProviderChannel::from_fd(Fd socket) {
  const int fd = socket.get();
  int type = 0;
  socklen_t length = sizeof type;
  if (::getsockopt(socket.get(), SOL_SOCKET, SO_TYPE, &type, &length) != 0)
    return fail(errno == ENOTSOCK ? ENOTSOCK : errno, "--serve-fd {}: not a socket serve passed", fd);
  if (type != SOCK_STREAM) return fail(ENOTSOCK, "--serve-fd {}: not a stream socket", fd);
  auto peer = handshake::peer_credentials(socket.get());
  if (!peer) return fail(peer.error().with_context(fmt::format("--serve-fd {}", fd)));
  if (auto allowed = handshake::check_peer_allowed(*peer, ::geteuid()); !allowed)
    return fail(allowed.error().with_context(fmt::format("--serve-fd {}", fd)));
  // Nothing this provider starts may inherit serve's channel.
  if (::fcntl(socket.get(), F_SETFD, FD_CLOEXEC) != 0) return fail(errno, "--serve-fd {}: FD_CLOEXEC", fd);
  return from_connection(std::move(socket), *peer);
}

ProviderChannel ProviderChannel::from_connection(Fd connection, handshake::PeerCredentials peer) {
  ProviderChannel channel(std::move(connection), peer);
  channel.who_ = serve_name(peer);
  return channel;
}

Result<void> ProviderChannel::say_hello(const ProviderReply& hello) {
  if (hello.op != ProviderOp::hello) return fail(EINVAL, "the first frame on the channel must be hello");
  return reply(hello);
}

Result<void> ProviderChannel::reply(const ProviderReply& reply) {
  const auto frame = handshake::length_prefixed(encode_provider_reply(reply));
  return handshake::send_frame(socket_.get(), frame, {}, kSendTimeoutMs, "resident provider reply");
}

Result<ProviderCall> ProviderChannel::next(int timeout_ms) {
  // EOF before a frame's first byte is serve closing the channel between requests: the
  // provider's normal end, told apart from a frame cut short.
  pollfd ready{socket_.get(), POLLIN, 0};
  int polled;
  do polled = ::poll(&ready, 1, timeout_ms < 0 ? -1 : timeout_ms);
  while (polled < 0 && errno == EINTR);
  if (polled < 0) return fail(errno, "waiting for a request from {}", who_);
  if (polled == 0) return fail(ETIMEDOUT, "no request from {} within {} ms", who_, timeout_ms);
  char first;
  ssize_t peeked;
  do peeked = ::recv(socket_.get(), &first, 1, MSG_PEEK | MSG_DONTWAIT);
  while (peeked < 0 && errno == EINTR);
  if (peeked == 0) return fail(ENODATA, "{} closed the channel", who_);
  auto frame = handshake::receive_frame(socket_.get(), wait_ms(timeout_ms), who_, -1, "resident provider request",
                                        kMaxProviderMessageBytes);
  if (!frame) return fail(frame.error());
  auto request = parse_provider_request(body_of(*frame), who_);
  if (!request) return fail(request.error());
  ProviderCall call;
  if (request->op != ProviderOp::region) {
    if (!frame->fds.empty())
      return fail(EPROTO, "{}: a {} request carried {} fd(s); only a region does", who_, provider_op_name(request->op),
                  frame->fds.size());
    call.request = std::move(*request);
    return call;
  }
  auto share = check_share_message(std::move(request->share), std::move(frame->fds), peer_, who_);
  if (!share) return fail(share.error());
  request->share = {};
  call.request = std::move(*request);
  call.region = std::move(*share);
  return call;
}

Result<ProviderListener> ProviderListener::listen(const std::filesystem::path& path) {
  if (path.empty() || !path.has_filename() || !path.is_absolute())
    return fail(EINVAL, "--serve {}: expected an absolute socket path in a 0700 directory of ours", path.string());
  std::error_code ec;
  if (std::filesystem::symlink_status(path, ec).type() != std::filesystem::file_type::not_found)
    return fail(EEXIST, "--serve {}: something is there already (another provider's socket, or a stale one: remove it)",
                path.string());
  auto listener = handshake::Listener::create_in(path.parent_path(), path.filename().string());
  if (!listener) return fail(listener.error().with_context(fmt::format("--serve {}", path.string())));
  return ProviderListener(std::move(*listener));
}

Result<ProviderChannel> ProviderListener::accept(int timeout_ms) {
  handshake::PeerCredentials peer;
  auto connection = listener_.accept(wait_ms(timeout_ms), &peer);
  if (!connection) return fail(connection.error());
  return ProviderChannel::from_connection(std::move(*connection), peer);
}

}  // namespace kvshare
