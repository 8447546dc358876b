#include "kvshare/fd.h"

#include "kvshare/sys.h"

namespace kvshare {

void Fd::reset(int fd) noexcept {
  if (fd_ >= 0) sys::ops().close(fd_);
  fd_ = fd;
}

}  // namespace kvshare
