// Brackets CPU access to a dma-buf: DMA_BUF_IOCTL_SYNC START on entry, END on exit, so a
// device's caches are flushed/invalidated around what the CPU reads or writes
// (include/uapi/linux/dma-buf.h). For a memfd it is a no-op guard.
#pragma once

#include <string>

#include "layout/error.h"

namespace kvshare {

class DmaBufCpuAccess {
 public:
  enum class Mode { read, write, read_write };

  DmaBufCpuAccess() = default;
  DmaBufCpuAccess(const DmaBufCpuAccess&) = delete;
  DmaBufCpuAccess& operator=(const DmaBufCpuAccess&) = delete;
  DmaBufCpuAccess(DmaBufCpuAccess&& other) noexcept;
  DmaBufCpuAccess& operator=(DmaBufCpuAccess&& other) noexcept;
  // Ends the access (SYNC_END); an END failure cannot be reported from a destructor and
  // is ignored: the kernel only fails it for a bad fd or flags.
  ~DmaBufCpuAccess();

  // Starts CPU access to the dma-buf `fd` (borrowed; must outlive the guard). Retries
  // EINTR/EAGAIN as the UAPI asks. `what` names the buffer in errors.
  static Result<DmaBufCpuAccess> begin(int fd, Mode mode, const std::string& what);
  // A guard that does nothing (for memfd regions).
  static DmaBufCpuAccess none() { return {}; }

  // Ends access now and reports a failure (instead of the destructor's silent END).
  Result<void> end();
  bool active() const { return fd_ >= 0; }

 private:
  DmaBufCpuAccess(int fd, unsigned long long flags) : fd_(fd), flags_(flags) {}
  int fd_ = -1;
  unsigned long long flags_ = 0;
};

}  // namespace kvshare
