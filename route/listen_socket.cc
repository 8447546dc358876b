#include "route/listen_socket.h"

#include <sys/socket.h>

#include <cerrno>

#include "kvshare/sys.h"

namespace kvshare::route {

Result<void> reuse_address(int fd) {
  const int yes = 1;
  if (sys::ops().setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes) != 0)
    return fail(errno, "setsockopt(SO_REUSEADDR) on socket fd {}", fd);
  return {};
}

Result<void> deepen_backlog(int fd) {
  if (sys::ops().listen(fd, SOMAXCONN) != 0) return fail(errno, "listen(fd {}, SOMAXCONN)", fd);
  return {};
}

}  // namespace kvshare::route
