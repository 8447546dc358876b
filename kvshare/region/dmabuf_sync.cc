#include "kvshare/region/dmabuf_sync.h"

#include <linux/dma-buf.h>

#include <cerrno>
#include <utility>

#include "kvshare/sys.h"

namespace kvshare {
namespace {

int sync_ioctl(int fd, unsigned long long flags) {
  dma_buf_sync sync{};
  sync.flags = flags;
  int rc;
  // The UAPI says to restart on EINTR and EAGAIN (dma_buf_ioctl may wait for fences).
  do {
    rc = sys::ops().ioctl_ptr(fd, DMA_BUF_IOCTL_SYNC, &sync);
  } while (rc != 0 && (errno == EINTR || errno == EAGAIN));
  return rc;
}

unsigned long long direction(DmaBufCpuAccess::Mode mode) {
  switch (mode) {
    case DmaBufCpuAccess::Mode::read:
      return DMA_BUF_SYNC_READ;
    case DmaBufCpuAccess::Mode::write:
      return DMA_BUF_SYNC_WRITE;
    case DmaBufCpuAccess::Mode::read_write:
      return DMA_BUF_SYNC_RW;
  }
  return DMA_BUF_SYNC_RW;
}

}  // namespace

DmaBufCpuAccess::DmaBufCpuAccess(DmaBufCpuAccess&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), flags_(other.flags_) {}

DmaBufCpuAccess& DmaBufCpuAccess::operator=(DmaBufCpuAccess&& other) noexcept {
  if (this != &other) {
    (void)end();
    fd_ = std::exchange(other.fd_, -1);
    flags_ = other.flags_;
  }
  return *this;
}

DmaBufCpuAccess::~DmaBufCpuAccess() { (void)end(); }

Result<DmaBufCpuAccess> DmaBufCpuAccess::begin(int fd, Mode mode, const std::string& what) {
  const unsigned long long flags = direction(mode);
  if (sync_ioctl(fd, DMA_BUF_SYNC_START | flags) != 0) return fail(errno, "DMA_BUF_IOCTL_SYNC START on {}", what);
  return DmaBufCpuAccess(fd, flags);
}

Result<void> DmaBufCpuAccess::end() {
  if (fd_ < 0) return {};
  const int fd = std::exchange(fd_, -1);
  if (sync_ioctl(fd, DMA_BUF_SYNC_END | flags_) != 0) return fail(errno, "DMA_BUF_IOCTL_SYNC END on dma-buf fd {}", fd);
  return {};
}

}  // namespace kvshare
