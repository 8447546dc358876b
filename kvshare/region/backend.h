// Where an exported KV region's memory comes from.
#pragma once

#include <cstdint>
#include <string_view>

#include "layout/error.h"

namespace kvshare {

enum class RegionBackend : uint8_t {
  dma_heap,       // a dma-buf allocated from /dev/dma_heap/system
  udmabuf,        // a dma-buf made from a sealed memfd by /dev/udmabuf
  memfd,          // a plain sealed memfd (no device can import it, every CPU process can)
  device_dmabuf,  // a dma-buf a GPU/NPU driver made (DRM PRIME), wrapped as is
};

// "dmaheap", "udmabuf", "memfd", "device" (the KVSHARE_EXPORT words, and the wire's "kind").
std::string_view region_backend_name(RegionBackend backend);

// Accepts the KVSHARE_EXPORT words memfd|udmabuf|dmaheap (device buffers are wrapped, not
// chosen). Anything else is EINVAL naming the value and the allowed list.
Result<RegionBackend> parse_region_backend(std::string_view name);

// True for the backends whose fd is a dma-buf (CPU access needs DMA_BUF_IOCTL_SYNC).
bool is_dmabuf_backend(RegionBackend backend);

}  // namespace kvshare
