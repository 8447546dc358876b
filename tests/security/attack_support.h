// The attack suite's tools: a child process that plays another local user (it drops to
// nobody, which needs root: CI runs this suite as root), private directories under /tmp
// that such a child can reach, and counting what arrives on a socket.
#pragma once

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>

#include <gtest/gtest.h>

namespace kvshare::security {

inline constexpr uid_t kNobodyUid = 65534;
inline constexpr gid_t kNobodyGid = 65534;

// Skips a case that plays another uid when not root, except in CI (CI=true, as
// scripts/test.sh sees it), which must run the whole suite: there it fails, so a runner
// that lost root cannot turn the cross-uid cases into silent skips.
inline bool running_in_ci() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::string(ci) == "true";
}

#define KVSHARE_NEED_ROOT()                                                                           \
  do {                                                                                                \
    if (::geteuid() != 0) {                                                                           \
      if (::kvshare::security::running_in_ci())                                                       \
        GTEST_FAIL() << "CI=true but not root: the attack suite's cross-uid cases need root to drop " \
                        "a child to nobody";                                                          \
      GTEST_SKIP() << "needs root to play another uid (CI runs this as root)";                        \
    }                                                                                                 \
  } while (0)

// What a socket's reader saw: bytes and SCM_RIGHTS fds (each closed as it came).
struct Arrivals {
  long connections = 0;
  long bytes = 0;
  long fds = 0;
};

// Reads `connection` to its end (or `timeout_ms`), counting bytes and fds and closing
// every fd. Syscalls only: it also runs in a forked child of a threaded process.
inline void drain(int connection, Arrivals& seen, int timeout_ms) {
  for (;;) {
    pollfd entry{connection, POLLIN, 0};
    if (::poll(&entry, 1, timeout_ms) <= 0) return;
    char data[4096];
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 253)];
    iovec iov{data, sizeof data};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    const ssize_t n = ::recvmsg(connection, &msg, MSG_CMSG_CLOEXEC);
    if (n <= 0) return;
    seen.bytes += n;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
        ::close(fd);
        ++seen.fds;
      }
    }
  }
}

// Waits up to `timeout_ms` for a first connection on `listener` (a listening socket),
// then drains it and any other already queued: what anyone who connected delivered.
inline Arrivals accept_and_drain(int listener, int timeout_ms) {
  Arrivals seen;
  for (;;) {
    pollfd entry{listener, POLLIN, 0};
    if (::poll(&entry, 1, seen.connections == 0 ? timeout_ms : 0) <= 0) return seen;
    const int connection = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (connection < 0) return seen;
    ++seen.connections;
    drain(connection, seen, timeout_ms);
    ::close(connection);
  }
}

// A listening AF_UNIX socket bound at `address` (`length` bytes of sockaddr_un, so an
// abstract name can hold its leading NUL). -1 on failure.
inline int listen_at(const sockaddr_un& address, socklen_t length) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&address), length) != 0 || ::listen(fd, 4) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

inline sockaddr_un unix_address(const std::string& path) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.data(), std::min(path.size(), sizeof address.sun_path - 1));
  return address;
}

// The attacker's raw send: `size` bytes with `fds` in one SCM_RIGHTS message (none when
// empty), as no well-behaved sender (handshake::send_message) would put them. Returns
// sendmsg's result. Syscalls only.
inline ssize_t send_raw(int socket_fd, const void* data, size_t size, const int* fds, size_t n_fds) {
  iovec iov{const_cast<void*>(data), size};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 253)] = {};
  if (n_fds > 0) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * n_fds);
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * n_fds);
    std::memcpy(CMSG_DATA(cmsg), fds, sizeof(int) * n_fds);
  }
  return ::sendmsg(socket_fd, &msg, MSG_NOSIGNAL);
}

// Drops this (child) process to nobody: no supplementary groups, then gid, then uid.
inline bool drop_to_nobody() {
  return ::setgroups(0, nullptr) == 0 && ::setresgid(kNobodyGid, kNobodyGid, kNobodyGid) == 0 &&
         ::setresuid(kNobodyUid, kNobodyUid, kNobodyUid) == 0;
}

// Forks a child that drops to nobody and exits with `body()` (99 if it could not drop).
// `body` must make only syscalls (the parent may have threads).
inline pid_t fork_as_nobody(const std::function<int()>& body) {
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  if (!drop_to_nobody()) ::_exit(99);
  ::_exit(body());
}

// The child's exit code, or -1 if it had to be killed after `timeout_ms`.
inline int wait_exit(pid_t pid, int timeout_ms) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (std::chrono::steady_clock::now() > end) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// A fresh directory under /tmp (not $TMPDIR: a child of another uid must be able to reach
// it, and renames between two of them stay on one filesystem), owned by `uid`, `mode`.
class SharedTmpDir {
 public:
  explicit SharedTmpDir(uid_t uid = ::geteuid(), mode_t mode = 0700) {
    std::string pattern = "/tmp/kvshare-attack-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) std::abort();
    path_ = pattern;
    if (::chown(path_.c_str(), uid, uid == ::geteuid() ? ::getegid() : kNobodyGid) != 0) std::abort();
    if (::chmod(path_.c_str(), mode) != 0) std::abort();
  }
  ~SharedTmpDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  SharedTmpDir(const SharedTmpDir&) = delete;
  SharedTmpDir& operator=(const SharedTmpDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace kvshare::security
