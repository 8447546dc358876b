// The broker's end of the handshake: a listening AF_UNIX socket in a private directory.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <string>

#include "kvshare/fd.h"
#include "kvshare/handshake/transport.h"
#include "layout/error.h"

namespace kvshare::handshake {

class Listener {
 public:
  // Creates a fresh directory (mode 0700) under `parent` (default: $TMPDIR or /tmp) and
  // listens on "share.sock" inside it. Close-on-exec. Fails with ENAMETOOLONG when the
  // socket path would not fit sun_path.
  static Result<Listener> create(const std::filesystem::path& parent = {});
  // Listens on `socket_name` inside `private_dir`, a directory the caller made and keeps:
  // it must be this uid's, not a link, mode 0700 (check_private_directory; EPERM names what
  // is wrong). The destructor unlinks the socket and leaves the directory. kvshare-serve
  // binds one per request in its own private directory: making and removing a directory
  // per request cost an rmdir each (docs/hybrid.md, "What it costs").
  static Result<Listener> create_in(const std::filesystem::path& private_dir, const std::string& socket_name);

  Listener(Listener&& other) noexcept;
  Listener& operator=(Listener&& other) noexcept;
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;
  // Closes the socket, unlinks it and, for create(), removes the directory (and anything
  // the broker left in it: the provider's header file), whatever path led here.
  ~Listener();

  const std::string& socket_path() const { return socket_path_; }
  const std::filesystem::path& directory() const { return directory_; }

  // Accepts one connection within `timeout_ms` (poll; never hangs) and checks its
  // SO_PEERCRED: same uid as this process, or root. ETIMEDOUT, EPERM naming the peer (whose
  // connection is closed unread: any fds it queued are dropped by the kernel), ECANCELED
  // once `cancel_fd` (borrowed, -1: none) is readable.
  Result<Fd> accept(int timeout_ms, PeerCredentials* peer = nullptr, int cancel_fd = -1);

  // accept() then receive_message() on it, within one `timeout_ms` budget overall.
  // `known_header`: see parse_json; `cancel_fd`: as for accept().
  Result<ReceivedMessage> accept_and_receive(int timeout_ms, PeerCredentials* peer = nullptr,
                                             std::string_view known_header = {}, int cancel_fd = -1);

 private:
  Listener() = default;
  Result<void> bind_and_listen();
  void cleanup() noexcept;
  Fd socket_;
  std::filesystem::path directory_;
  std::string socket_path_;
  bool owns_directory_ = false;  // create() made it; create_in()'s belongs to the caller
};

}  // namespace kvshare::handshake
