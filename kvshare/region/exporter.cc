#include "kvshare/region/exporter.h"

#include <fcntl.h>
#include <linux/dma-heap.h>
#include <linux/udmabuf.h>
#include <sys/mman.h>
#include <unistd.h>
#include <xf86drm.h>

#include <cerrno>
#include <fstream>

#include "kvshare/env.h"
#include "kvshare/region/fd_inspect.h"
#include "kvshare/sys.h"

namespace kvshare {
namespace {

// udmabuf's module parameter default (drivers/dma-buf/udmabuf.c, size_limit_mb = 64).
constexpr uint64_t kUdmabufDefaultLimitMb = 64;

std::string chunk_name(uint32_t chunk_index) { return fmt::format("kvshare-chunk-{}", chunk_index); }

uint64_t udmabuf_limit_bytes(const ExportOptions& options) {
  if (options.udmabuf_limit_bytes) return *options.udmabuf_limit_bytes;
  std::ifstream in("/sys/module/udmabuf/parameters/size_limit_mb");
  uint64_t limit_mb = 0;
  if (in >> limit_mb && limit_mb > 0) return limit_mb << 20;
  return kUdmabufDefaultLimitMb << 20;
}

// A memfd of `size_bytes` with `seals` added. MFD_ALLOW_SEALING so the importer can see
// F_SEAL_SHRINK; MFD_CLOEXEC so no child inherits it by accident.
Result<Fd> sealed_memfd(uint32_t chunk_index, uint64_t size_bytes, int seals) {
  const std::string name = chunk_name(chunk_index);
  Fd fd(sys::ops().memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) return fail(errno, "memfd_create {}", name);
  if (sys::ops().ftruncate(fd.get(), static_cast<off_t>(size_bytes)) != 0)
    return fail(errno, "ftruncate memfd {} (fd {}) to {} bytes", name, fd.get(), size_bytes);
  if (sys::ops().fcntl_int(fd.get(), F_ADD_SEALS, seals) != 0)
    return fail(errno, "F_ADD_SEALS {:#x} on memfd {} (fd {})", seals, name, fd.get());
  return fd;
}

Result<Fd> allocate_memfd(uint32_t chunk_index, uint64_t size_bytes) {
  // Shrink and grow sealed, then the seals themselves: a peer can neither truncate the
  // pages under the owner's mapping (SIGBUS) nor lift the seal.
  return sealed_memfd(chunk_index, size_bytes, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
}

Result<Fd> allocate_dma_heap(const ExportOptions& options, uint64_t size_bytes) {
  Fd heap(sys::ops().open(options.dma_heap_path.c_str(), O_RDWR | O_CLOEXEC, 0));
  if (!heap) return fail(errno, "open {}", options.dma_heap_path);
  dma_heap_allocation_data data{};
  data.len = size_bytes;
  data.fd_flags = O_RDWR | O_CLOEXEC;
  if (sys::ops().ioctl_ptr(heap.get(), DMA_HEAP_IOCTL_ALLOC, &data) != 0)
    return fail(errno, "DMA_HEAP_IOCTL_ALLOC of {} bytes on {}", size_bytes, options.dma_heap_path);
  return Fd(static_cast<int>(data.fd));
}

Result<Fd> allocate_udmabuf(const ExportOptions& options, uint32_t chunk_index, uint64_t size_bytes) {
  const uint64_t limit = udmabuf_limit_bytes(options);
  if (size_bytes > limit) return fail(EFBIG, "{} bytes is past udmabuf's size_limit_mb {}", size_bytes, limit >> 20);
  const long page = ::sysconf(_SC_PAGESIZE);
  if (page > 0 && size_bytes % static_cast<uint64_t>(page) != 0)
    return fail(EINVAL, "{} bytes is not a multiple of the {}-byte page udmabuf needs", size_bytes, page);
  Fd device(sys::ops().open(options.udmabuf_path.c_str(), O_RDWR | O_CLOEXEC, 0));
  if (!device) return fail(errno, "open {}", options.udmabuf_path);
  // udmabuf needs F_SEAL_SHRINK and refuses F_SEAL_WRITE (include/uapi/linux/udmabuf.h,
  // check_memfd_seals); F_SEAL_GROW is harmless and keeps the size fixed.
  auto memfd = sealed_memfd(chunk_index, size_bytes, F_SEAL_SHRINK | F_SEAL_GROW);
  if (!memfd) return fail(memfd.error());
  udmabuf_create create{};
  create.memfd = static_cast<uint32_t>(memfd->get());
  create.flags = UDMABUF_FLAGS_CLOEXEC;
  create.offset = 0;
  create.size = size_bytes;
  const int dmabuf = sys::ops().ioctl_ptr(device.get(), UDMABUF_CREATE, &create);
  if (dmabuf < 0) return fail(errno, "UDMABUF_CREATE of {} bytes on {}", size_bytes, options.udmabuf_path);
  // The dma-buf holds the memfd's pages; the memfd itself can go.
  return Fd(dmabuf);
}

Result<Fd> allocate(RegionBackend backend, const ExportOptions& options, uint32_t chunk_index, uint64_t size_bytes) {
  switch (backend) {
    case RegionBackend::dma_heap:
      return allocate_dma_heap(options, size_bytes);
    case RegionBackend::udmabuf:
      return allocate_udmabuf(options, chunk_index, size_bytes);
    case RegionBackend::memfd:
      return allocate_memfd(chunk_index, size_bytes);
    case RegionBackend::device_dmabuf:
      break;
  }
  return fail(EINVAL, "backend {} cannot allocate; wrap the driver's dma-buf instead", region_backend_name(backend));
}

}  // namespace

Result<ExportOptions> ExportOptions::from_env() {
  ExportOptions options;
  auto forced = export_backend_override();
  if (!forced) return fail(forced.error());
  options.forced = *forced;
  return options;
}

Result<ExportedRegion> export_chunk(const layout::ShareChunk& chunk, uint32_t chunk_index,
                                    const ExportOptions& options) {
  if (chunk.size_bytes == 0 || chunk.size_bytes % layout::kShareAlign != 0)
    return fail(EINVAL, "chunk {}: size {} bytes is not a positive multiple of {}", chunk_index, chunk.size_bytes,
                layout::kShareAlign);
  std::vector<RegionBackend> order;
  if (options.forced)
    order = {*options.forced};
  else
    order = {RegionBackend::dma_heap, RegionBackend::udmabuf, RegionBackend::memfd};

  std::string reasons;
  for (RegionBackend backend : order) {
    auto fd = allocate(backend, options, chunk_index, chunk.size_bytes);
    if (!fd && options.forced)
      return fail(Error(fd.error().errno_value(),
                        fmt::format("chunk {} ({} bytes), backend forced by {}: {}: {}", chunk_index, chunk.size_bytes,
                                    kExportBackendEnv, region_backend_name(backend), fd.error().message())));
    if (!fd) {
      if (!reasons.empty()) reasons += "; ";
      reasons += fmt::format("{}: {}", region_backend_name(backend), fd.error().what());
      continue;
    }
    const std::string what = fmt::format("{} fd {} (chunk {})", region_backend_name(backend), fd->get(), chunk_index);
    auto mapping = Mapping::map(fd->get(), 0, chunk.size_bytes, true, what);
    if (!mapping) return fail(mapping.error());
    ExportedRegion region;
    region.fd = std::move(*fd);
    region.size_bytes = chunk.size_bytes;
    region.layout_hash = chunk.layout_hash;
    region.chunk = chunk_index;
    region.backend = backend;
    region.fallback_reason = std::move(reasons);
    region.mapping = std::move(*mapping);
    return region;
  }
  return fail(ENOTSUP, "chunk {} ({} bytes): no backend could export it ({})", chunk_index, chunk.size_bytes, reasons);
}

Result<std::vector<ExportedRegion>> export_regions(const layout::ShareLayout& layout, const ExportOptions& options) {
  if (layout.chunks.empty()) return fail(EINVAL, "share layout has no chunks: nothing to export");
  std::vector<ExportedRegion> regions;
  regions.reserve(layout.chunks.size());
  for (size_t i = 0; i < layout.chunks.size(); ++i) {
    auto region = export_chunk(layout.chunks[i], static_cast<uint32_t>(i), options);
    if (!region) return fail(region.error());
    regions.push_back(std::move(*region));
  }
  return regions;
}

Result<ExportedRegion> wrap_device_dmabuf(Fd dmabuf, uint64_t offset, const layout::ShareChunk& chunk,
                                          uint32_t chunk_index) {
  const std::string what = fmt::format("device dma-buf fd {} (chunk {})", dmabuf.get(), chunk_index);
  auto kind = inspect_fd(dmabuf.get(), offset + chunk.size_bytes, what);
  if (!kind) return fail(kind.error());
  if (kind->kind != FdKind::dmabuf) return fail(EINVAL, "{}: is a memfd, not a dma-buf a driver made", what);
  const long page = ::sysconf(_SC_PAGESIZE);
  if (page > 0 && offset % static_cast<uint64_t>(page) != 0)
    return fail(EINVAL, "{}: offset {} is not page-aligned", what, offset);
  auto mapping = Mapping::map(dmabuf.get(), offset, chunk.size_bytes, true, what);
  if (!mapping) return fail(mapping.error());
  ExportedRegion region;
  region.fd = std::move(dmabuf);
  region.offset = offset;
  region.size_bytes = chunk.size_bytes;
  region.layout_hash = chunk.layout_hash;
  region.chunk = chunk_index;
  region.backend = RegionBackend::device_dmabuf;
  region.mapping = std::move(*mapping);
  return region;
}

Result<Fd> drm_prime_export(int drm_fd, uint32_t gem_handle) {
  int prime_fd = -1;
  const int rc = ::drmPrimeHandleToFD(drm_fd, gem_handle, DRM_CLOEXEC | DRM_RDWR, &prime_fd);
  // libdrm returns -1 with errno set (drmIoctl), never a negative errno.
  if (rc != 0 || prime_fd < 0) return fail(errno, "DRM PRIME export of GEM handle {} on DRM fd {}", gem_handle, drm_fd);
  return Fd(prime_fd);
}

std::string describe_backends(const std::vector<ExportedRegion>& regions) {
  if (regions.empty()) return "none";
  bool uniform = true;
  for (const auto& region : regions)
    uniform = uniform && region.backend == regions.front().backend &&
              region.fallback_reason == regions.front().fallback_reason;
  auto one = [](const ExportedRegion& region) {
    std::string text(region_backend_name(region.backend));
    if (!region.fallback_reason.empty()) text += fmt::format(" (passed over: {})", region.fallback_reason);
    return text;
  };
  if (uniform) return one(regions.front());
  std::string text;
  for (const auto& region : regions) {
    if (!text.empty()) text += ", ";
    text += fmt::format("chunk {}: {}", region.chunk, one(region));
  }
  return text;
}

}  // namespace kvshare
