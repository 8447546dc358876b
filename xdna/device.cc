#include "xdna/device.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>
#include <xf86drm.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#ifdef KVSHARE_HAVE_XRT
#include <xrt/xrt_bo.h>
#include <xrt/xrt_device.h>
#endif

#include "kvshare/sys.h"
#include "xdna/amdxdna_uapi.h"

namespace kvshare::xdna {
namespace {

// accel<N> names under the directory, ascending N.
Result<std::vector<unsigned>> accel_minors(const std::string& accel_dir) {
  DIR* dir = opendir(accel_dir.c_str());
  if (dir == nullptr)
    return fail(errno, "looking for an AMD XDNA NPU: cannot list {} (no DRM accel devices on this machine?)",
                accel_dir);
  std::vector<unsigned> minors;
  while (const dirent* entry = readdir(dir)) {
    unsigned minor = 0;
    char tail = 0;
    if (std::sscanf(entry->d_name, "accel%u%c", &minor, &tail) == 1) minors.push_back(minor);
  }
  closedir(dir);
  std::sort(minors.begin(), minors.end());
  return minors;
}

// The DRM driver name of an open node, or why there is none.
Result<std::string> drm_driver_name(int fd, const std::string& path) {
  drmVersionPtr version = drmGetVersion(fd);
  if (version == nullptr) return fail(errno, "{}: not a DRM node (DRM_IOCTL_VERSION failed)", path);
  std::string name(version->name, static_cast<size_t>(std::max(0, version->name_len)));
  drmFreeVersion(version);
  return name;
}

}  // namespace

Result<XdnaDevice> find_device(const std::string& accel_dir) {
  auto minors = accel_minors(accel_dir);
  if (!minors) return fail(minors.error());
  std::vector<std::string> seen;
  for (unsigned minor : *minors) {
    const std::string path = accel_dir + "/accel" + std::to_string(minor);
    Fd fd(sys::ops().open(path.c_str(), O_RDWR | O_CLOEXEC, 0));
    if (!fd) {
      seen.push_back(fmt::format("{} (open: {})", path, std::strerror(errno)));
      continue;
    }
    auto driver = drm_driver_name(fd.get(), path);
    if (!driver) {
      seen.push_back(fmt::format("{} (not a DRM node)", path));
      continue;
    }
    if (*driver == uapi::kDriverName) return XdnaDevice{std::move(fd), path, *driver};
    seen.push_back(fmt::format("{} (driver \"{}\")", path, *driver));
  }
  if (seen.empty())
    return fail(ENODEV, "looking for an AMD XDNA NPU: no accel<N> node in {} (is the amdxdna driver loaded?)",
                accel_dir);
  std::string list;
  for (const auto& entry : seen) list += (list.empty() ? "" : ", ") + entry;
  return fail(ENODEV, "looking for an AMD XDNA NPU: no node in {} is driven by \"{}\": {}", accel_dir,
              uapi::kDriverName, list);
}

GemHandle::~GemHandle() {
  // DRM_IOCTL_GEM_CLOSE drops this file's reference; the dma-buf lives on in its exporter
  // and in every other importer.
  drm_gem_close request{};
  request.handle = handle;
  sys::ops().ioctl_ptr(device_fd, DRM_IOCTL_GEM_CLOSE, &request);
}

std::shared_ptr<GemHandle> GemHandles::find(uint32_t handle) {
  std::lock_guard lock(mutex_);
  auto it = handles_.find(handle);
  return it == handles_.end() ? nullptr : it->second.lock();
}

void GemHandles::remember(const std::shared_ptr<GemHandle>& handle) {
  std::lock_guard lock(mutex_);
  std::erase_if(handles_, [](const auto& entry) { return entry.second.expired(); });
  handles_[handle->handle] = handle;
}

Result<ImportedBo> import_dmabuf(const XdnaDevice& device, int dmabuf_fd, uint64_t offset, uint64_t size_bytes,
                                 const std::string& what) {
  // The range must lie inside the dma-buf (its size is what lseek(SEEK_END) reports).
  const off_t buffer_bytes = ::lseek(dmabuf_fd, 0, SEEK_END);
  if (buffer_bytes >= 0 &&
      (offset > static_cast<uint64_t>(buffer_bytes) || size_bytes > static_cast<uint64_t>(buffer_bytes) - offset))
    return fail(EINVAL, "importing {} (dma-buf fd {}) into {}: bytes {}..{} pass its end at {}", what, dmabuf_fd,
                device.path, offset, offset + size_bytes, buffer_bytes);
  // DRM_IOCTL_PRIME_FD_TO_HANDLE, what drmPrimeFDToHandle issues, through the syscall seam
  // so tests can stand in for the driver.
  drm_prime_handle prime{};
  prime.fd = dmabuf_fd;
  if (sys::ops().ioctl_ptr(device.fd.get(), DRM_IOCTL_PRIME_FD_TO_HANDLE, &prime) != 0)
    return fail(errno, "importing {} (dma-buf fd {}, {} bytes at offset {}) into {}: PRIME fd-to-handle failed", what,
                dmabuf_fd, size_bytes, offset, device.path);
  // A dma-buf this file already imported comes back with the same handle: share it.
  if (auto known = device.handles->find(prime.handle)) return ImportedBo(std::move(known), offset, size_bytes);
  uapi::GetBoInfo info{};
  info.handle = prime.handle;
  if (sys::ops().ioctl_ptr(device.fd.get(), uapi::kIoctlGetBoInfo, &info) != 0) {
    const int error = errno;
    GemHandle closes_the_handle(device.fd.get(), prime.handle, 0);
    return fail(error, "importing {} (dma-buf fd {}) into {}: DRM_IOCTL_AMDXDNA_GET_BO_INFO on handle {} failed", what,
                dmabuf_fd, device.path, prime.handle);
  }
  auto handle = std::make_shared<GemHandle>(device.fd.get(), prime.handle, info.xdna_addr);
  device.handles->remember(handle);
  return ImportedBo(std::move(handle), offset, size_bytes);
}

Result<std::vector<ImportedBo>> import_region(const XdnaDevice& device, std::span<const int> chunk_fds,
                                              std::span<const uint64_t> chunk_sizes,
                                              std::span<const uint64_t> chunk_offsets) {
  if (chunk_fds.size() != chunk_sizes.size())
    return fail(EINVAL, "importing a region into {}: {} fds but the layout has {} chunks", device.path,
                chunk_fds.size(), chunk_sizes.size());
  if (!chunk_offsets.empty() && chunk_offsets.size() != chunk_fds.size())
    return fail(EINVAL, "importing a region into {}: {} fds but {} offsets", device.path, chunk_fds.size(),
                chunk_offsets.size());
  std::vector<ImportedBo> bos;
  for (size_t i = 0; i < chunk_fds.size(); ++i) {
    const uint64_t offset = chunk_offsets.empty() ? 0 : chunk_offsets[i];
    auto bo = import_dmabuf(device, chunk_fds[i], offset, chunk_sizes[i], fmt::format("region chunk {}", i));
    if (!bo) return fail(bo.error());
    bos.push_back(std::move(*bo));
  }
  return bos;
}

#ifdef KVSHARE_HAVE_XRT
struct XrtBuffer::Impl {
  xrt::device device;
  xrt::bo bo;
};
bool has_xrt() { return true; }

Result<XrtBuffer> import_xrt(unsigned device_index, int dmabuf_fd, const std::string& what) {
  // XRT throws; nothing crosses our boundary but an Error.
  try {
    XrtBuffer buffer;
    xrt::device device(device_index);
    // XRT 2.13 (Debian bookworm) takes the device as its xclDeviceHandle and the dma-buf fd as an
    // xclBufferExportHandle.
    xrt::bo bo(static_cast<xclDeviceHandle>(device), static_cast<xclBufferExportHandle>(dmabuf_fd));
    buffer.impl_ = std::make_unique<XrtBuffer::Impl>(XrtBuffer::Impl{std::move(device), std::move(bo)});
    return buffer;
  } catch (const std::exception& e) {
    return fail(EIO, "importing {} (dma-buf fd {}) as an xrt::bo on XRT device {}: {}", what, dmabuf_fd, device_index,
                e.what());
  }
}
#else
struct XrtBuffer::Impl {};
bool has_xrt() { return false; }

Result<XrtBuffer> import_xrt(unsigned device_index, int dmabuf_fd, const std::string& what) {
  return fail(ENOTSUP,
              "importing {} (dma-buf fd {}) as an xrt::bo on XRT device {}: this kvshare was built without XRT "
              "(install libxrt-dev and configure with -DKVSHARE_WITH_XRT=ON)",
              what, dmabuf_fd, device_index);
}
#endif

XrtBuffer::XrtBuffer() = default;
XrtBuffer::XrtBuffer(XrtBuffer&&) noexcept = default;
XrtBuffer& XrtBuffer::operator=(XrtBuffer&&) noexcept = default;
XrtBuffer::~XrtBuffer() = default;

}  // namespace kvshare::xdna
