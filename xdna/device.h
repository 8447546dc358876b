// The AMD XDNA NPU as a DRM accel device, and the import of the shared region's dma-bufs
// as the device's own buffer objects. The CPU never writes through a driver-made mapping
// of an imported buffer (that route poisons the submission): it writes through kvshare's
// own mapping of the same dma-buf, and the NPU sees the bytes through the imported BO.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "kvshare/fd.h"
#include "layout/error.h"

namespace kvshare::xdna {

// Where DRM accel nodes live.
inline constexpr const char* kAccelDir = "/dev/accel";

class GemHandles;

// An opened amdxdna node.
struct XdnaDevice {
  Fd fd;               // the accel node, O_RDWR | O_CLOEXEC
  std::string path;    // "/dev/accel/accel0"
  std::string driver;  // "amdxdna"
  // The GEM handles imported on `fd`. DRM PRIME gives one handle per dma-buf per file, so
  // two imports of one dma-buf (two chunks of one buffer, or one buffer twice) share it
  // and it must be closed once, when the last ImportedBo of it goes.
  std::shared_ptr<GemHandles> handles = std::make_shared<GemHandles>();
};

// One GEM handle on a device fd, closed (DRM_IOCTL_GEM_CLOSE) when destroyed.
struct GemHandle {
  int device_fd = -1;
  uint32_t handle = 0;
  uint64_t buffer_address = 0;  // amdxdna xdna_addr of the whole dma-buf
  GemHandle(int fd, uint32_t h, uint64_t address) : device_fd(fd), handle(h), buffer_address(address) {}
  GemHandle(const GemHandle&) = delete;
  GemHandle& operator=(const GemHandle&) = delete;
  ~GemHandle();
};

// The live handles of one device fd, by handle number (thread-safe).
class GemHandles {
 public:
  // The live handle `handle`, or null.
  std::shared_ptr<GemHandle> find(uint32_t handle);
  void remember(const std::shared_ptr<GemHandle>& handle);

 private:
  std::mutex mutex_;
  std::map<uint32_t, std::weak_ptr<GemHandle>> handles_;
};

// Opens the first `accel<N>` node under `accel_dir` (ascending N) whose DRM driver
// (drmGetVersion) is amdxdna. Fails with ENODEV when there is none, naming the directory
// and every node looked at with what it turned out to be (another driver, unopenable,
// not a DRM node); ENOENT when the directory does not exist.
Result<XdnaDevice> find_device(const std::string& accel_dir = kAccelDir);

// A dma-buf (or a range of it) imported into the device: a share of its GEM handle on the
// device fd. Borrows the device fd, which must outlive it.
class ImportedBo {
 public:
  ImportedBo() = default;
  ImportedBo(std::shared_ptr<GemHandle> handle, uint64_t offset, uint64_t size_bytes)
      : handle_(std::move(handle)), offset_(offset), size_bytes_(size_bytes) {}

  uint32_t handle() const { return handle_ ? handle_->handle : 0; }
  uint64_t offset() const { return offset_; }  // where the range starts inside the dma-buf
  uint64_t size_bytes() const { return size_bytes_; }
  // The NPU's address of the range's first byte (the buffer's xdna_addr plus the offset),
  // 0 if the driver gave none.
  uint64_t device_address() const {
    return handle_ && handle_->buffer_address != 0 ? handle_->buffer_address + offset_ : 0;
  }

 private:
  std::shared_ptr<GemHandle> handle_;
  uint64_t offset_ = 0;
  uint64_t size_bytes_ = 0;
};

// Imports bytes [offset, offset + size_bytes) of `dmabuf_fd` (borrowed) with DRM PRIME
// fd-to-handle on the device and asks the driver for the buffer's device address
// (DRM_IOCTL_AMDXDNA_GET_BO_INFO) once per handle. `what` names the buffer in errors
// ("region chunk 2"). Fails with the ioctl's errno, or EINVAL when the range passes the
// end of the dma-buf.
Result<ImportedBo> import_dmabuf(const XdnaDevice& device, int dmabuf_fd, uint64_t offset, uint64_t size_bytes,
                                 const std::string& what);

// Imports every chunk of a region (fds borrowed; offsets and sizes from the handshake, same
// order; `chunk_offsets` empty means all 0).
Result<std::vector<ImportedBo>> import_region(const XdnaDevice& device, std::span<const int> chunk_fds,
                                              std::span<const uint64_t> chunk_sizes,
                                              std::span<const uint64_t> chunk_offsets = {});

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
