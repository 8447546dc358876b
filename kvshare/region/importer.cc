#include "kvshare/region/importer.h"

#include <unistd.h>

#include <cerrno>

namespace kvshare {

Result<ImportedRegion> import_region(Fd fd, uint32_t chunk, uint64_t offset, uint64_t size_bytes, bool writable) {
  const std::string what = fmt::format("fd {} (chunk {})", fd.get(), chunk);
  if (size_bytes == 0) return fail(EINVAL, "{}: zero-sized chunk", what);
  const long page = ::sysconf(_SC_PAGESIZE);
  if (page > 0 && offset % static_cast<uint64_t>(page) != 0)
    return fail(EINVAL, "{}: offset {} is not a multiple of the {}-byte page", what, offset, page);
  auto inspection = inspect_fd(fd.get(), offset + size_bytes, what);
  if (!inspection) return fail(inspection.error());
  const std::string mapped_what = fmt::format("{} fd {} (chunk {})", fd_kind_name(inspection->kind), fd.get(), chunk);
  auto mapping = Mapping::map(fd.get(), offset, size_bytes, writable, mapped_what);
  if (!mapping) return fail(mapping.error());
  ImportedRegion region;
  region.fd = std::move(fd);
  region.kind = inspection->kind;
  region.chunk = chunk;
  region.offset = offset;
  region.size_bytes = size_bytes;
  region.mapping = std::move(*mapping);
  return region;
}

Result<ImportedShare> ImportedShare::import(const layout::ShareLayout& layout, std::vector<Fd> fds,
                                            std::span<const uint64_t> offsets, bool writable) {
  if (fds.size() != layout.chunks.size())
    return fail(EINVAL, "{} fds for a layout of {} chunks (one fd per chunk, in chunk order)", fds.size(),
                layout.chunks.size());
  if (!offsets.empty() && offsets.size() != fds.size())
    return fail(EINVAL, "{} fd offsets for {} fds", offsets.size(), fds.size());
  ImportedShare share;
  share.layout_ = layout;
  share.regions_.reserve(fds.size());
  for (size_t i = 0; i < fds.size(); ++i) {
    const uint64_t offset = offsets.empty() ? 0 : offsets[i];
    auto region =
        import_region(std::move(fds[i]), static_cast<uint32_t>(i), offset, layout.chunks[i].size_bytes, writable);
    if (!region) return fail(region.error());
    share.regions_.push_back(std::move(*region));
  }
  for (const auto& region : share.regions_) share.chunk_bytes_.push_back(region.mapping.bytes());
  return share;
}

std::vector<ChunkFile> ImportedShare::chunk_files() const {
  std::vector<ChunkFile> files;
  for (const auto& region : regions_)
    files.push_back(region.kind == FdKind::memfd ? ChunkFile{region.fd.get(), region.offset, region.chunk}
                                                 : ChunkFile{-1, 0, region.chunk});
  return files;
}

Result<TensorView> ImportedShare::view(std::string_view name) const { return tensor_view(layout_, chunk_bytes_, name); }

Result<LayerDestination> ImportedShare::layer(uint32_t cache_index, uint32_t il) const {
  return layer_destination(layout_, chunk_bytes_, cache_index, il);
}

Result<std::vector<DmaBufCpuAccess>> ImportedShare::begin_cpu_access(DmaBufCpuAccess::Mode mode) const {
  std::vector<DmaBufCpuAccess> guards;
  for (const auto& region : regions_) {
    if (region.kind != FdKind::dmabuf) continue;
    auto guard = DmaBufCpuAccess::begin(region.fd.get(), mode,
                                        fmt::format("dma-buf fd {} (chunk {})", region.fd.get(), region.chunk));
    if (!guard) return fail(guard.error());
    guards.push_back(std::move(*guard));
  }
  return guards;
}

}  // namespace kvshare
