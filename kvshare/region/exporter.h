// The exporter: one shareable region per share_layout chunk, each an fd another process
// can map, plus the owner's own mapping of it.
//
// Lifetime: the owner (the decoder) keeps the ExportedRegion for as long as its KV cache
// lives. A peer that received the fd keeps the pages alive after the owner has gone; the
// owner's mapping stays valid whatever the peer does, because every region is sealed
// against shrinking (memfd) or cannot shrink at all (dma-buf): no peer can make the
// other side SIGBUS. Who writes when is the protocol's business (docs/protocol.md): the
// provider between the share and the adopt, the decoder after it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kvshare/fd.h"
#include "kvshare/mapping.h"
#include "kvshare/region/backend.h"
#include "layout/error.h"
#include "layout/share_layout.h"

namespace kvshare {

struct ExportedRegion {
  Fd fd;                     // what goes over SCM_RIGHTS
  uint64_t offset = 0;       // where the chunk starts inside fd (0 for what we allocate)
  uint64_t size_bytes = 0;   // the chunk's size, a multiple of 4096
  uint64_t layout_hash = 0;  // the chunk's share_layout hash
  uint32_t chunk = 0;        // index in the share_layout (= position in the fd list)
  RegionBackend backend = RegionBackend::memfd;
  // Why preferred backends were passed over for this chunk, "" when the first choice
  // worked: "dmaheap: /dev/dma_heap/system: No such file or directory; udmabuf: ...".
  std::string fallback_reason;
  Mapping mapping;  // the owner's read-write mapping of [offset, offset+size)
};

struct ExportOptions {
  // A forced backend (KVSHARE_EXPORT): no fallback, its failure is the error.
  std::optional<RegionBackend> forced;
  std::string dma_heap_path = "/dev/dma_heap/system";
  std::string udmabuf_path = "/dev/udmabuf";
  // udmabuf refuses a buffer past its size_limit_mb; nullopt reads
  // /sys/module/udmabuf/parameters/size_limit_mb, falling back to the kernel's 64 MiB.
  std::optional<uint64_t> udmabuf_limit_bytes;

  // The defaults with KVSHARE_EXPORT applied; fails on an unknown KVSHARE_EXPORT value.
  static Result<ExportOptions> from_env();
};

// Allocates one region of `chunk.size_bytes`: dma-heap, then udmabuf, then memfd (or the
// forced backend only), maps it read-write for the owner and zero-fills nothing (fresh
// pages read as zero). Fails only when every allowed backend failed; the error lists why
// each one did.
Result<ExportedRegion> export_chunk(const layout::ShareChunk& chunk, uint32_t chunk_index,
                                    const ExportOptions& options);

// Every chunk of `layout`, in fd order. Nothing leaks when a later chunk fails.
Result<std::vector<ExportedRegion>> export_regions(const layout::ShareLayout& layout, const ExportOptions& options);

// Wraps a dma-buf a GPU/NPU driver made (so a device decoder hands its own buffers over):
// checks it is a dma-buf of at least offset + chunk.size_bytes bytes and maps that range
// for the owner. Takes `dmabuf`.
Result<ExportedRegion> wrap_device_dmabuf(Fd dmabuf, uint64_t offset, const layout::ShareChunk& chunk,
                                          uint32_t chunk_index);

// DRM PRIME: the dma-buf fd of GEM object `gem_handle` on the DRM device `drm_fd`
// (borrowed), close-on-exec and read-write (drmPrimeHandleToFD).
Result<Fd> drm_prime_export(int drm_fd, uint32_t gem_handle);

// "memfd (passed over: dmaheap: ...; udmabuf: ...)" when every chunk went the same way,
// else one entry per chunk — what a decoder logs at start.
std::string describe_backends(const std::vector<ExportedRegion>& regions);

}  // namespace kvshare
