// The importer: maps the regions a peer handed over, after checking each fd, with this
// process's own mapping (never a driver-made one: engine#812), and hands out tensor views.
//
// Lifetime: the ImportedShare owns the received fds and its mappings; the pages stay valid
// after the exporter exits (the fd holds them) and cannot shrink (memfd seal / dma-buf).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvshare/fd.h"
#include "kvshare/mapping.h"
#include "kvshare/region/chunk_file.h"
#include "kvshare/region/dmabuf_sync.h"
#include "kvshare/region/fd_inspect.h"
#include "kvshare/region/tensor_view.h"
#include "layout/error.h"
#include "layout/share_layout.h"

namespace kvshare {

struct ImportedRegion {
  Fd fd;
  FdKind kind = FdKind::memfd;
  uint32_t chunk = 0;
  uint64_t offset = 0;
  uint64_t size_bytes = 0;
  Mapping mapping;
};

// Checks `fd` (inspect_fd: memfd with F_SEAL_SHRINK or dma-buf, >= offset + size_bytes)
// and maps [offset, offset + size_bytes), read-write when `writable`. Takes `fd`; it is
// closed on every failure.
Result<ImportedRegion> import_region(Fd fd, uint32_t chunk, uint64_t offset, uint64_t size_bytes, bool writable);

class ImportedShare {
 public:
  // Imports one fd per chunk of `layout`, in order. `offsets` gives where each chunk
  // starts inside its fd (empty: all 0). Takes every fd; all are closed on failure.
  // EINVAL when the fd count differs from the chunk count, or any fd fails import_region.
  static Result<ImportedShare> import(const layout::ShareLayout& layout, std::vector<Fd> fds,
                                      std::span<const uint64_t> offsets, bool writable);

  const layout::ShareLayout& layout() const { return layout_; }
  const std::vector<ImportedRegion>& regions() const { return regions_; }
  std::span<const std::span<std::byte>> chunk_bytes() const { return chunk_bytes_; }
  // Each chunk's descriptor (borrowed from this share) for writing without the mapping's
  // first-touch faults (chunk_file.h); fd -1 for a dma-buf chunk, which has no write(2).
  std::vector<ChunkFile> chunk_files() const;

  Result<TensorView> view(std::string_view name) const;
  Result<LayerDestination> layer(uint32_t cache_index, uint32_t il) const;

  // Brackets CPU access to every dma-buf region (memfd regions need none). Keep the
  // returned guards alive while reading or writing through the views.
  Result<std::vector<DmaBufCpuAccess>> begin_cpu_access(DmaBufCpuAccess::Mode mode) const;

 private:
  layout::ShareLayout layout_;
  std::vector<ImportedRegion> regions_;
  std::vector<std::span<std::byte>> chunk_bytes_;
};

}  // namespace kvshare
