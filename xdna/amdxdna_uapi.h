// The slice of the amdxdna DRM UAPI kvshare uses, written from the kernel's documented ABI
// (include/uapi/drm/amdxdna_accel.h, Linux 6.14+; drivers/accel/amdxdna). Debian's kernel
// headers predate that driver, so the structures live here. Layouts and ioctl numbers
// are ABI: the static_asserts pin the sizes the kernel header implies.
#pragma once

#include <libdrm/drm.h>  // DRM_IOWR, DRM_COMMAND_BASE, the PRIME and GEM structs

#include <cstdint>

namespace kvshare::xdna::uapi {

// The name DRM_IOCTL_VERSION reports for the driver (drivers/accel/amdxdna/amdxdna_pci_drv.c).
inline constexpr const char* kDriverName = "amdxdna";

// enum amdxdna_drm_ioctl_id: the command index added to DRM_COMMAND_BASE.
enum IoctlId : unsigned {
  kCreateHwctx = 0,
  kDestroyHwctx = 1,
  kConfigHwctx = 2,
  kCreateBo = 3,
  kGetBoInfo = 4,
  kSyncBo = 5,
  kExecCmd = 6,
  kGetInfo = 7,
  kSetState = 8,
};

// enum amdxdna_bo_type.
enum BoType : uint32_t { kBoInvalid = 0, kBoShmem = 1, kBoDevHeap = 2, kBoDev = 3, kBoCmd = 4 };

// struct amdxdna_drm_get_bo_info: asks for a handle's device address. `ext`, `ext_flags`
// and `pad` must be zero.
struct GetBoInfo {
  uint64_t ext = 0;
  uint64_t ext_flags = 0;
  uint32_t handle = 0;
  uint32_t pad = 0;
  uint64_t map_offset = 0;  // out: fake offset for mmap of the DRM node (kvshare never uses it)
  uint64_t vaddr = 0;       // out
  uint64_t xdna_addr = 0;   // out: the NPU's address of the buffer
};
static_assert(sizeof(GetBoInfo) == 48);

// struct amdxdna_drm_sync_bo: cache maintenance for a range of a BO.
struct SyncBo {
  uint32_t handle = 0;
  uint32_t direction = 0;  // SYNC_DIRECT_TO_DEVICE 0, SYNC_DIRECT_FROM_DEVICE 1
  uint64_t offset = 0;
  uint64_t size = 0;
};
static_assert(sizeof(SyncBo) == 24);
inline constexpr uint32_t kSyncToDevice = 0;
inline constexpr uint32_t kSyncFromDevice = 1;

inline constexpr unsigned long kIoctlGetBoInfo = DRM_IOWR(DRM_COMMAND_BASE + kGetBoInfo, GetBoInfo);
inline constexpr unsigned long kIoctlSyncBo = DRM_IOWR(DRM_COMMAND_BASE + kSyncBo, SyncBo);

}  // namespace kvshare::xdna::uapi
