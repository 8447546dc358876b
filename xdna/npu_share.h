// A provider's share imported into the NPU: one buffer object per chunk of the decoder's
// region, and each cache tensor's device address, for an NPU engine that DMAs K and V
// straight into the decoder's cache. The CPU side keeps its own mappings (ImportedShare).
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "kvshare/region/importer.h"
#include "layout/error.h"
#include "xdna/device.h"

namespace kvshare::xdna {

class NpuShare {
 public:
  // Imports every chunk of `share` (its fds borrowed; the device's GEM handles keep the
  // buffers) into `device`. Fails with the driver's errno naming the chunk.
  static Result<NpuShare> import(XdnaDevice device, const ImportedShare& share);

  // The device address of tensor `name`'s first byte: its chunk's buffer address plus the
  // tensor's offset. ENOENT for a tensor the layout does not place, ENODATA when the driver
  // gave the chunk's buffer no address.
  Result<uint64_t> device_address(const ImportedShare& share, std::string_view name) const;

  const XdnaDevice& device() const { return device_; }
  const std::vector<ImportedBo>& buffers() const { return buffers_; }

 private:
  NpuShare(XdnaDevice device, std::vector<ImportedBo> buffers)
      : device_(std::move(device)), buffers_(std::move(buffers)) {}
  // The buffer objects borrow the device's fd: declared after it, they are destroyed first.
  XdnaDevice device_;
  std::vector<ImportedBo> buffers_;
};

}  // namespace kvshare::xdna
