// The provider's end of the resident provider protocol (kvshare/share/provider_protocol.h):
// what a resident prefill provider (kvshare-prefill --serve, llama-kvshare-prefill --serve,
// an NPU engine through the C API) links to take serve's requests.
//
//   auto channel = ProviderChannel::from_fd(Fd(3));            // --serve-fd 3: serve started us
//   channel->say_hello(hello);
//   while (auto call = channel->next()) {                  // ENODATA: serve closed it
//     if (call->request.op == ProviderOp::region) { map call->region ...; channel->reply(ok); }
//     else { prefill ...; channel->reply(ok or an error); }
//   }
//
// or, for a provider started on its own (kvshare-serve --prefill-provider-socket PATH):
//
//   auto listener = ProviderListener::listen(PATH);       // PATH's directory: 0700, ours
//   while (auto channel = listener->accept()) { ... as above, one serve at a time ... }
//
// Both ends check the other's uid (SO_PEERCRED: ours or root). A region request's share is
// checked like a decoder's (check_share_message): the header parsed and validated, every fd
// against the layout, before the caller sees it.
#pragma once

#include <filesystem>
#include <optional>
#include <string>

#include "kvshare/fd.h"
#include "kvshare/handshake/listener.h"
#include "kvshare/handshake/transport.h"
#include "kvshare/share/broker.h"
#include "kvshare/share/provider_protocol.h"
#include "layout/error.h"

namespace kvshare {

// One request from serve.
struct ProviderCall {
  ProviderRequest request;              // op region or prefill
  std::optional<ReceivedShare> region;  // op region: the decoder's share, checked, with its fds
};

class ProviderChannel {
 public:
  // Takes `socket`, a connected AF_UNIX stream socket (serve's socket pair end), and checks that
  // its peer runs as our uid or root (EPERM naming it; ENOTSOCK for anything else).
  static Result<ProviderChannel> from_fd(Fd socket);
  // Takes an accepted connection whose peer was checked already.
  static ProviderChannel from_connection(Fd connection, handshake::PeerCredentials peer);

  int fd() const { return socket_.get(); }
  const handshake::PeerCredentials& peer() const { return peer_; }

  // The first frame: `hello.op` must be hello.
  Result<void> say_hello(const ProviderReply& hello);
  // The next request, waiting at most `timeout_ms` (-1: as long as it takes). ENODATA when
  // serve closed the channel between requests (the provider's normal end); EPROTO for a
  // frame that breaks the protocol (fds on anything but a region, a region whose fds do
  // not match its share) and EINVAL for a message that does not parse, each naming what.
  // After an error the channel is unusable: the caller ends it.
  Result<ProviderCall> next(int timeout_ms = -1);
  Result<void> reply(const ProviderReply& reply);

 private:
  ProviderChannel(Fd socket, handshake::PeerCredentials peer) : socket_(std::move(socket)), peer_(peer) {}
  Fd socket_;
  handshake::PeerCredentials peer_;
  std::string who_;  // "kvshare-serve (pid N)"
};

class ProviderListener {
 public:
  // Listens on `path`: its directory must be a private one of ours (0700, not a link;
  // handshake::check_private_directory), and nothing may exist at `path` itself (EEXIST:
  // another provider's socket, or a stale one to remove by hand). The socket is removed on
  // destruction.
  static Result<ProviderListener> listen(const std::filesystem::path& path);
  const std::string& socket_path() const { return listener_.socket_path(); }
  // The next serve that connects, its uid checked (a refused peer is closed and accept
  // waits for the next); -1: as long as it takes.
  Result<ProviderChannel> accept(int timeout_ms = -1);

 private:
  explicit ProviderListener(handshake::Listener listener) : listener_(std::move(listener)) {}
  handshake::Listener listener_;
};

}  // namespace kvshare
