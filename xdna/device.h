// The AMD XDNA NPU as a DRM accel device, and the import of the shared region's dma-bufs
// as the device's own buffer objects. The CPU never writes through a driver-made mapping
// of an imported buffer (that route poisons the submission): it writes through kvshare's
// own mapping of the same dma-buf, and the NPU sees the bytes through the imported BO.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvshare/fd.h"
#include "layout/error.h"

namespace kvshare::xdna {

// Where DRM accel nodes live.
inline constexpr const char* kAccelDir = "/dev/accel";

// An opened amdxdna node.
struct XdnaDevice {
  Fd fd;              // the accel node, O_RDWR | O_CLOEXEC
  std::string path;   // "/dev/accel/accel0"
  std::string driver; // "amdxdna"
};

// Opens the first `accel<N>` node under `accel_dir` (ascending N) whose DRM driver
// (drmGetVersion) is amdxdna. Fails with ENODEV when there is none, naming the directory
// and every node looked at with what it turned out to be (another driver, unopenable,
// not a DRM node); ENOENT when the directory does not exist.
Result<XdnaDevice> find_device(const std::string& accel_dir = kAccelDir);

// A dma-buf imported into the device: a GEM handle on the device fd, closed on
// destruction. Borrows the device fd, which must outlive it.
class ImportedBo {
 public:
  ImportedBo() = default;
  ImportedBo(int device_fd, uint32_t handle, uint64_t size_bytes, uint64_t device_address)
      : device_fd_(device_fd), handle_(handle), size_bytes_(size_bytes), device_address_(device_address) {}
  ImportedBo(ImportedBo&& other) noexcept;
  ImportedBo& operator=(ImportedBo&& other) noexcept;
  ImportedBo(const ImportedBo&) = delete;
  ImportedBo& operator=(const ImportedBo&) = delete;
  ~ImportedBo();

  uint32_t handle() const { return handle_; }
  uint64_t size_bytes() const { return size_bytes_; }
  uint64_t device_address() const { return device_address_; }  // amdxdna xdna_addr, 0 if unknown

 private:
  void reset() noexcept;
  int device_fd_ = -1;
  uint32_t handle_ = 0;
  uint64_t size_bytes_ = 0;
  uint64_t device_address_ = 0;
};

// Imports `dmabuf_fd` (borrowed) with DRM PRIME fd-to-handle on the device and asks the
// driver for its device address (DRM_IOCTL_AMDXDNA_GET_BO_INFO). `what` names the buffer
// in errors ("region chunk 2"). Fails with the ioctl's errno.
Result<ImportedBo> import_dmabuf(const XdnaDevice& device, int dmabuf_fd, uint64_t size_bytes, const std::string& what);

// Imports every chunk of a region (fds borrowed, sizes from the layout, same order).
Result<std::vector<ImportedBo>> import_region(const XdnaDevice& device, std::span<const int> chunk_fds,
                                              std::span<const uint64_t> chunk_sizes);

// The same dma-buf as an xrt::bo made from its export handle, for engines that submit
// through XRT. Only built with XRT (KVSHARE_WITH_XRT and libxrt-dev found); otherwise
// import fails with ENOTSUP saying so.
class XrtBuffer {
 public:
  XrtBuffer();
  XrtBuffer(XrtBuffer&&) noexcept;
  XrtBuffer& operator=(XrtBuffer&&) noexcept;
  ~XrtBuffer();
  struct Impl;
  Impl* impl() const { return impl_.get(); }

 private:
  friend Result<XrtBuffer> import_xrt(unsigned device_index, int dmabuf_fd, const std::string& what);
  std::unique_ptr<Impl> impl_;
};

// Opens XRT device `device_index` and imports `dmabuf_fd` (borrowed) as an xrt::bo.
Result<XrtBuffer> import_xrt(unsigned device_index, int dmabuf_fd, const std::string& what);

// True when this build has the XRT path.
bool has_xrt();

}  // namespace kvshare::xdna
