// The syscall seam. Every system call kvshare makes that can fail in an interesting way
// goes through sys::ops(), so a test can replace one call to inject EINTR, EAGAIN,
// ENOSPC, a short transfer or MSG_CTRUNC and check the retry count, the message and
// the cleanup. Production code never changes the table.
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>

#include <cstddef>
#include <cstdint>

namespace kvshare::sys {

struct Ops {
  int (*open)(const char* path, int flags, mode_t mode);
  int (*close)(int fd);
  ssize_t (*read)(int fd, void* buf, size_t count);
  ssize_t (*write)(int fd, const void* buf, size_t count);
  ssize_t (*pread)(int fd, void* buf, size_t count, off_t offset);
  ssize_t (*pwrite)(int fd, const void* buf, size_t count, off_t offset);
  int (*fsync)(int fd);
  int (*ftruncate)(int fd, off_t length);
  int (*fcntl_int)(int fd, int cmd, int arg);
  int (*ioctl_ptr)(int fd, unsigned long request, void* arg);
  int (*memfd_create)(const char* name, unsigned int flags);
  void* (*mmap)(void* addr, size_t length, int prot, int flags, int fd, off_t offset);
  int (*munmap)(void* addr, size_t length);
  int (*socket)(int domain, int type, int protocol);
  int (*connect)(int fd, const struct sockaddr* addr, socklen_t len);
  int (*bind)(int fd, const struct sockaddr* addr, socklen_t len);
  int (*listen)(int fd, int backlog);
  int (*setsockopt)(int fd, int level, int name, const void* value, socklen_t len);
  int (*accept4)(int fd, struct sockaddr* addr, socklen_t* len, int flags);
  ssize_t (*sendmsg)(int fd, const struct msghdr* msg, int flags);
  ssize_t (*recvmsg)(int fd, struct msghdr* msg, int flags);
  int (*poll)(struct pollfd* fds, nfds_t nfds, int timeout_ms);
  int (*rename)(const char* from, const char* to);
  int (*unlink)(const char* path);
  // The spawner's parent side (never between fork and exec, where only the real calls run).
  int (*kill)(pid_t pid, int sig);
  pid_t (*waitpid)(pid_t pid, int* status, int options);
  int (*madvise)(void* addr, size_t length, int advice);
  // The NPU lock's non-blocking tries (xdna/npu_lock.cc), so a test can see a waiter wait.
  int (*flock)(int fd, int operation);
};

// The table in force. Reads are cheap (one pointer load).
const Ops& ops();
// The real system calls.
const Ops& real_ops();

// Replaces the table for the lifetime of the object (tests only; not thread-safe
// against concurrent kvshare calls, which tests do not make while overriding).
class ScopedOverride {
 public:
  explicit ScopedOverride(const Ops& replacement);
  ~ScopedOverride();
  ScopedOverride(const ScopedOverride&) = delete;
  ScopedOverride& operator=(const ScopedOverride&) = delete;

 private:
  const Ops* previous_;
  Ops table_;
};

}  // namespace kvshare::sys
