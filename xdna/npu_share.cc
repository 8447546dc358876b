#include "xdna/npu_share.h"

#include <fmt/format.h>

#include <cerrno>

namespace kvshare::xdna {

Result<NpuShare> NpuShare::import(XdnaDevice device, const ImportedShare& share) {
  std::vector<int> fds;
  std::vector<uint64_t> sizes, offsets;
  for (const ImportedRegion& region : share.regions()) {
    fds.push_back(region.fd.get());
    sizes.push_back(region.size_bytes);
    offsets.push_back(region.offset);
  }
  auto buffers = import_region(device, fds, sizes, offsets);
  if (!buffers) return fail(buffers.error().with_context(fmt::format("importing the share into {}", device.path)));
  return NpuShare(std::move(device), std::move(*buffers));
}

Result<uint64_t> NpuShare::device_address(const ImportedShare& share, std::string_view name) const {
  auto view = share.view(name);
  if (!view) return fail(view.error());
  const layout::SharedTensor& placed = *view->placement;
  if (placed.chunk >= buffers_.size())
    return fail(EINVAL, "{}: chunk {} was not imported ({} buffer objects)", name, placed.chunk, buffers_.size());
  const uint64_t buffer_address = buffers_[placed.chunk].device_address();
  if (buffer_address == 0)
    return fail(ENODATA, "{}: the driver gave chunk {}'s buffer no device address", name, placed.chunk);
  return buffer_address + placed.offset;
}

}  // namespace kvshare::xdna
