#include "kvshare/region/backend.h"

#include <cerrno>

namespace kvshare {

std::string_view region_backend_name(RegionBackend backend) {
  switch (backend) {
    case RegionBackend::dma_heap:
      return "dmaheap";
    case RegionBackend::udmabuf:
      return "udmabuf";
    case RegionBackend::memfd:
      return "memfd";
    case RegionBackend::device_dmabuf:
      return "device";
  }
  return "unknown";
}

Result<RegionBackend> parse_region_backend(std::string_view name) {
  if (name == "memfd") return RegionBackend::memfd;
  if (name == "udmabuf") return RegionBackend::udmabuf;
  if (name == "dmaheap") return RegionBackend::dma_heap;
  return fail(EINVAL, "export backend \"{}\" is not one of memfd, udmabuf, dmaheap", name);
}

bool is_dmabuf_backend(RegionBackend backend) { return backend != RegionBackend::memfd; }

}  // namespace kvshare
