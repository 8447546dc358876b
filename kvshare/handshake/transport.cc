#include "kvshare/handshake/transport.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "kvshare/sys.h"

namespace kvshare::handshake {
namespace {

using Clock = std::chrono::steady_clock;

class Deadline {
 public:
  explicit Deadline(int timeout_ms) : end_(Clock::now() + std::chrono::milliseconds(timeout_ms)) {}
  // Milliseconds left, 0 when past (poll then returns at once).
  int remaining_ms() const {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end_ - Clock::now()).count();
    return left > 0 ? static_cast<int>(left) : 0;
  }

 private:
  Clock::time_point end_;
};

// Waits for `events` on fd; 0 on ready, else an errno (ETIMEDOUT when the deadline passed,
// ECANCELED once `cancel_fd` (-1: none) is readable).
int wait_for(int fd, short events, const Deadline& deadline, int cancel_fd = -1) {
  for (;;) {
    pollfd entries[2] = {{fd, events, 0}, {cancel_fd, POLLIN, 0}};
    const int n = sys::ops().poll(entries, cancel_fd >= 0 ? 2 : 1, deadline.remaining_ms());
    if (n > 0 && cancel_fd >= 0 && entries[1].revents != 0) return ECANCELED;
    if (n > 0) return 0;  // ready, or POLLHUP/POLLERR: the next call reports it
    if (n == 0) return ETIMEDOUT;
    if (errno != EINTR) return errno;
  }
}

// Control space for the most fds one message may carry.
constexpr size_t kControlBytes = CMSG_SPACE(sizeof(int) * kMaxFds);

// Wraps every SCM_RIGHTS fd of `msg` into `out` (first, before anything can fail).
void take_fds(msghdr& msg, std::vector<Fd>& out) {
  for (cmsghdr* cmsg = CMSG_FIRSTHDR(&msg); cmsg != nullptr; cmsg = CMSG_NXTHDR(&msg, cmsg)) {
    if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const unsigned char* data = CMSG_DATA(cmsg);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, data + i * sizeof(int), sizeof(int));
      out.emplace_back(fd);
    }
  }
}

}  // namespace

Result<PeerCredentials> peer_credentials(int socket_fd) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(socket_fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
    return fail(errno, "SO_PEERCRED on socket fd {}", socket_fd);
  return PeerCredentials{cred.pid, cred.uid, cred.gid};
}

Result<void> check_peer_allowed(const PeerCredentials& peer, uid_t our_uid) {
  if (peer.uid == our_uid || peer.uid == 0) return {};
  return fail(EPERM, "handshake from pid {}: peer runs as uid {}, only uid {} or root may share KV with this process",
              peer.pid, peer.uid, our_uid);
}

Result<Fd> connect_unix(const std::string& path, int timeout_ms) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path)
    return fail(ENAMETOOLONG, "socket path {} is {} bytes, the limit is {}", path, path.size(),
                sizeof addr.sun_path - 1);
  std::memcpy(addr.sun_path, path.data(), path.size());
  Fd fd(sys::ops().socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return fail(errno, "socket(AF_UNIX) to connect to {}", path);
  // A blocking AF_UNIX connect waits only while the listener's backlog is full, and
  // SO_SNDTIMEO bounds that wait (unix_stream_connect uses the send timeout).
  timeval tv{timeout_ms / 1000, static_cast<suseconds_t>((timeout_ms % 1000) * 1000)};
  if (::setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0)
    return fail(errno, "SO_SNDTIMEO on socket fd {} for {}", fd.get(), path);
  int rc;
  do {
    rc = sys::ops().connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int error = errno == EAGAIN || errno == EINPROGRESS ? ETIMEDOUT : errno;
    return fail(error, "connect to {}", path);
  }
  return fd;
}

std::string printable_path(std::string_view path) {
  std::string out;
  for (const char c : path) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte == 0)
      out += "\\0";
    else if (byte < 0x20 || byte == 0x7f)
      out += fmt::format("\\x{:02x}", byte);
    else
      out += c;
  }
  return out;
}

namespace {

// What lstat says `mode` is, for a refusal that names it.
std::string_view file_kind_name(mode_t mode) {
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a socket";
}

}  // namespace

Result<void> check_private_directory(const std::string& directory, uid_t our_uid, std::string_view what) {
  // O_NOFOLLOW with O_DIRECTORY fails on a symbolic link (ENOTDIR) instead of following it.
  Fd dir(::open(directory.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!dir) {
    if (errno == ENOTDIR || errno == ELOOP) {
      struct stat link_stat {};
      if (::lstat(directory.c_str(), &link_stat) == 0 && S_ISLNK(link_stat.st_mode))
        return fail(EPERM, "{}: its directory {} is a symbolic link", what, directory);
    }
    return fail(errno, "{}: opening its directory {}", what, directory);
  }
  struct stat dir_stat {};
  if (::fstat(dir.get(), &dir_stat) != 0) return fail(errno, "{}: fstat of its directory {}", what, directory);
  if (dir_stat.st_uid != our_uid)
    return fail(EPERM,
                "{}: its directory {} is owned by uid {}, not by this process's uid {}; only a directory of "
                "our own (the broker's 0700 directory) keeps other users from the socket",
                what, directory, dir_stat.st_uid, our_uid);
  if ((dir_stat.st_mode & 077) != 0)
    return fail(EPERM,
                "{}: its directory {} has mode {:04o}: group or others can reach the socket (the broker's "
                "directory is 0700)",
                what, directory, dir_stat.st_mode & 07777);
  return {};
}

namespace {

// The checks on the path alone, before connecting: who else could have bound it or reach it.
Result<void> check_listener_path(const std::string& path, uid_t our_uid) {
  const std::string shown = printable_path(path);
  if (path.empty()) return fail(EPERM, "share socket path is empty; give the broker's socket path");
  if (path.front() == '\0')
    return fail(EPERM,
                "share socket \"{}\": a path starting with a NUL byte is in the abstract namespace, which "
                "has no permissions (any local user could be listening); refused, nothing sent",
                shown);
  if (const size_t nul = path.find('\0'); nul != std::string::npos)
    return fail(EPERM, "share socket \"{}\": holds a NUL byte at offset {}; refused, nothing sent", shown, nul);
  if (path.front() != '/')
    return fail(EPERM,
                "share socket \"{}\": the path is relative; only an absolute path names one socket "
                "whatever this process's working directory; refused, nothing sent",
                shown);
  const size_t slash = path.rfind('/');
  const std::string name = path.substr(slash + 1);
  const std::string directory = slash == 0 ? std::string("/") : path.substr(0, slash);
  if (name.empty() || name == "." || name == "..")
    return fail(EPERM, "share socket \"{}\": the path does not end in a file name; refused, nothing sent", shown);

  struct stat socket_stat {};
  if (::lstat(path.c_str(), &socket_stat) != 0) return fail(errno, "share socket {}: lstat", shown);
  if (S_ISLNK(socket_stat.st_mode))
    return fail(EPERM,
                "share socket {}: is a symbolic link; a sender of KV fds connects only to the broker's own "
                "socket, never through a link; refused, nothing sent",
                shown);
  if (!S_ISSOCK(socket_stat.st_mode))
    return fail(ENOTSOCK, "share socket {}: is {}, not a socket; refused, nothing sent", shown,
                file_kind_name(socket_stat.st_mode));

  if (auto private_dir = check_private_directory(directory, our_uid, fmt::format("share socket {}", shown));
      !private_dir)
    return fail(private_dir.error().errno_value(), "{}; refused, nothing sent", private_dir.error().message());
  return {};
}

}  // namespace

Result<Fd> connect_checked_listener(const std::string& path, int timeout_ms) {
  const uid_t our_uid = ::geteuid();
  if (auto checked = check_listener_path(path, our_uid); !checked) return fail(checked.error());
  auto connection = connect_unix(path, timeout_ms);
  if (!connection) return fail(connection.error());
  // The path checks say who else could reach the socket; SO_PEERCRED says who listens.
  // It is the credential of listen()'s caller, so a socket renamed into our directory,
  // or a directory swapped after the checks, still shows the stranger's uid here.
  auto listener = peer_credentials(connection->get());
  if (!listener) return fail(listener.error().with_context(fmt::format("share socket {}", path)));
  if (listener->uid != our_uid && listener->uid != 0)
    return fail(EPERM,
                "share socket {}: the listener (pid {}) runs as uid {}; only uid {} or root may receive this "
                "decoder's KV; refused, nothing sent",
                path, listener->pid, listener->uid, our_uid);
  return connection;
}

Result<void> send_frame(int socket_fd, std::span<const std::byte> frame, std::span<const int> fds, int timeout_ms,
                        std::string_view what) {
  if (fds.size() > kMaxFds)
    return fail(EINVAL, "cannot send {} fds in one message, the limit is {}", fds.size(), kMaxFds);
  const Deadline deadline(timeout_ms);
  alignas(cmsghdr) unsigned char control[kControlBytes];
  size_t sent = 0;
  while (sent < frame.size()) {
    iovec iov{const_cast<std::byte*>(frame.data()) + sent, frame.size() - sent};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (sent == 0 && !fds.empty()) {
      // The fds ride with the first byte: a receiver reading the length gets them too.
      std::memset(control, 0, sizeof control);
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
      cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
      cmsg->cmsg_level = SOL_SOCKET;
      cmsg->cmsg_type = SCM_RIGHTS;
      cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
    }
    const ssize_t n = sys::ops().sendmsg(socket_fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        const int waited = wait_for(socket_fd, POLLOUT, deadline);
        if (waited != 0)
          return fail(waited, "sending {} on socket fd {}: {} of {} bytes sent", what, socket_fd, sent, frame.size());
        continue;
      }
      return fail(errno, "sending {} on socket fd {}: {} of {} bytes sent", what, socket_fd, sent, frame.size());
    }
    sent += static_cast<size_t>(n);
  }
  return {};
}

Result<void> send_message(int socket_fd, const Message& message, std::span<const int> fds, int timeout_ms) {
  if (fds.size() > kMaxFds)
    return fail(EINVAL, "cannot send {} fds in one message, the limit is {}", fds.size(), kMaxFds);
  if (message.type == MessageType::share && fds.size() != message.fds.size())
    return fail(EINVAL, "share message declares {} fds, {} given", message.fds.size(), fds.size());
  if (message.type == MessageType::refuse && !fds.empty())
    return fail(EINVAL, "a refusal carries no fds, {} given", fds.size());
  auto frame = encode_frame(message);
  if (!frame) return fail(frame.error());
  return send_frame(socket_fd, *frame, fds, timeout_ms, "handshake");
}

Result<ReceivedFrame> receive_frame(int socket_fd, int timeout_ms, std::string_view peer, int cancel_fd,
                                    std::string_view what, uint32_t max_bytes) {
  ReceivedFrame received;
  const Deadline deadline(timeout_ms);
  alignas(cmsghdr) unsigned char control[kControlBytes];
  std::byte prefix[kLengthBytes];
  std::vector<std::byte>& body = received.body;
  size_t got = 0;  // bytes of the frame read so far
  size_t total = kLengthBytes;

  while (got < total) {
    std::byte* into = got < kLengthBytes ? prefix + got : body.data() + (got - kLengthBytes);
    const size_t want = got < kLengthBytes ? kLengthBytes - got : total - got;
    iovec iov{into, want};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    const ssize_t n = sys::ops().recvmsg(socket_fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        const int waited = wait_for(socket_fd, POLLIN, deadline, cancel_fd);
        if (waited != 0)
          return fail(waited, "receiving {} from {}: {} of {} bytes read", what, peer, got,
                      got < kLengthBytes ? std::string("?") : std::to_string(total));
        continue;
      }
      return fail(errno, "receiving {} from {}: recvmsg on socket fd {} at byte {}", what, peer, socket_fd, got);
    }
    // Wrap the fds before anything else: an early return must not leak a peer's descriptors.
    const size_t fds_before = received.fds.size();
    if (msg.msg_controllen > 0) take_fds(msg, received.fds);
    if (msg.msg_flags & MSG_CTRUNC)
      return fail(EPROTO,
                  "receiving {} from {}: recvmsg on socket fd {}: control data truncated (MSG_CTRUNC), "
                  "{} fds closed",
                  what, peer, socket_fd, received.fds.size());
    if (received.fds.size() > fds_before && got > 0)
      return fail(EPROTO, "receiving {} from {}: {} fds arrived at byte {}, not with the first bytes; all closed", what,
                  peer, received.fds.size() - fds_before, got);
    if (received.fds.size() > kMaxFds)
      return fail(EPROTO, "receiving {} from {}: {} fds, the limit is {}; all closed", what, peer, received.fds.size(),
                  kMaxFds);
    if (n == 0)
      return fail(EPROTO, "receiving {} from {}: short read: peer closed the socket at byte {} of {}", what, peer, got,
                  got < kLengthBytes ? std::string("the length prefix") : std::to_string(total));
    got += static_cast<size_t>(n);
    if (got == kLengthBytes && total == kLengthBytes) {
      uint32_t length = 0;
      for (size_t i = 0; i < kLengthBytes; ++i) length |= static_cast<uint32_t>(prefix[i]) << (8 * i);
      if (length > max_bytes)
        return fail(EMSGSIZE, "receiving {} from {}: length prefix says {} bytes, the limit is {}", what, peer, length,
                    max_bytes);
      if (length == 0) return fail(EPROTO, "receiving {} from {}: length prefix is 0", what, peer);
      body.resize(length);
      total = kLengthBytes + length;
    }
  }
  return received;
}

Result<ReceivedMessage> receive_message(int socket_fd, int timeout_ms, std::string_view peer,
                                        std::string_view known_header, int cancel_fd) {
  auto frame = receive_frame(socket_fd, timeout_ms, peer, cancel_fd);
  if (!frame) return fail(frame.error());
  ReceivedMessage received;
  received.fds = std::move(frame->fds);
  auto message = parse_json(std::string_view(reinterpret_cast<const char*>(frame->body.data()), frame->body.size()),
                            peer, known_header);
  if (!message) return fail(message.error());
  const size_t declared = message->type == MessageType::share ? message->fds.size() : 0;
  if (received.fds.size() > declared)
    return fail(EPROTO, "handshake from {}: {} fds received, the message declares {}; all closed", peer,
                received.fds.size(), declared);
  if (received.fds.size() < declared)
    return fail(EPROTO, "handshake from {}: the message declares {} fds, {} arrived; all closed", peer, declared,
                received.fds.size());
  received.message = std::move(*message);
  return received;
}

}  // namespace kvshare::handshake
