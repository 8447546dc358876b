// A region chunk written through its descriptor (pwrite) rather than through a mapping.
//
// Why: a provider is a fresh process per request, so its mapping of the decoder's region
// is fresh too, and every 4 KiB page it writes takes a page fault on first touch: about
// 100,000 for the 400 MB of a 4096-token Qwen3-Coder-30B-A3B prompt. On a VM with shadow
// page tables each such first touch costs far more than the copy of its 4 KiB (measured for
// issue 16: docs/protocol.md, "Regions" and "What the route adds, equal work"). pwrite()
// copies through the kernel's own linear map, which is always mapped. Only memfd chunks
// can be written so; a dma-buf has no write(2) and keeps its mapping (and its
// DMA_BUF_IOCTL_SYNC brackets).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "layout/error.h"

namespace kvshare {

struct ChunkFile {
  int fd = -1;          // borrowed; -1: this chunk cannot be written through a descriptor
  uint64_t offset = 0;  // where the chunk starts inside the fd
  uint32_t chunk = 0;   // the chunk's index, for messages

  bool writable() const { return fd >= 0; }
};

// Writes `bytes` at `offset_in_chunk` of `file`, resuming short writes and EINTR. Blocks
// on the copy only (a memfd never waits for a disk). Fails with the errno of pwrite, or
// EIO on a write that makes no progress, naming the chunk, fd and offset reached.
Result<void> write_chunk_file(const ChunkFile& file, uint64_t offset_in_chunk, std::span<const std::byte> bytes);

}  // namespace kvshare
