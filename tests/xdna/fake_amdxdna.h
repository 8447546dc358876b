// A stand-in amdxdna driver behind the syscall seam (kvshare/sys.h): no machine here has
// an NPU, so PRIME import and GET_BO_INFO are answered by this fake.
#pragma once

#include <fcntl.h>
#include <libdrm/drm.h>

#include <cerrno>
#include <cstring>

#include "kvshare/sys.h"
#include "xdna/device.h"

namespace kvshare::xdna::testing {

// A stand-in amdxdna driver: PRIME import hands out handle 7, GET_BO_INFO answers
// address 0x40000 (or fails when told to), GEM_CLOSE is counted.
struct FakeDriver {
  static inline int gem_closes = 0;
  static inline uint32_t closed_handle = 0;
  static inline bool fail_bo_info = false;
  static int ioctl(int fd, unsigned long request, void* arg) {
    if (request == DRM_IOCTL_PRIME_FD_TO_HANDLE) {
      static_cast<drm_prime_handle*>(arg)->handle = 7;
      return 0;
    }
    if (request == DRM_IOCTL_GEM_CLOSE) {
      ++gem_closes;
      closed_handle = static_cast<drm_gem_close*>(arg)->handle;
      return 0;
    }
    if (_IOC_NR(request) == DRM_COMMAND_BASE + 4) {  // DRM_AMDXDNA_GET_BO_INFO
      if (fail_bo_info) {
        errno = EINVAL;
        return -1;
      }
      // struct amdxdna_drm_get_bo_info: xdna_addr is the last of six 8-byte fields.
      uint64_t address = 0x40000;
      std::memcpy(static_cast<char*>(arg) + 40, &address, 8);
      return 0;
    }
    return sys::real_ops().ioctl_ptr(fd, request, arg);
  }
};

// FakeDriver behind the syscall seam for one scope, its counters reset; GET_BO_INFO fails
// when `fail_bo_info`.
class ScopedFakeDriver {
 public:
  explicit ScopedFakeDriver(bool fail_bo_info = false) : override_(fake_ops()) {
    FakeDriver::gem_closes = 0;
    FakeDriver::closed_handle = 0;
    FakeDriver::fail_bo_info = fail_bo_info;
  }
  ~ScopedFakeDriver() { FakeDriver::fail_bo_info = false; }

 private:
  static sys::Ops fake_ops() {
    sys::Ops ops = sys::real_ops();
    ops.ioctl_ptr = FakeDriver::ioctl;
    return ops;
  }
  sys::ScopedOverride override_;
};

inline XdnaDevice fake_device() {
  return XdnaDevice{Fd(::open("/dev/null", O_RDWR | O_CLOEXEC)), "/dev/accel/accel0", "amdxdna"};
}

}  // namespace kvshare::xdna::testing
