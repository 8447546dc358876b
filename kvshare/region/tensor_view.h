// Typed views of the cache tensors inside mapped chunks: what a decoder reads and a
// provider writes, addressed by llama.cpp's names (cache_k_l3) through the ShareLayout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "layout/error.h"
#include "layout/share_layout.h"

namespace kvshare {

struct TensorView {
  const layout::SharedTensor* placement = nullptr;  // into the layout the view came from
  std::byte* base = nullptr;                        // first byte of the tensor in this process's mapping
  uint64_t row_bytes = 0;                           // nb[1]
  uint64_t rows = 0;                                // nbytes / row_bytes: ne[1]*ne[2]*ne[3]
  layout::GgmlType type = layout::GgmlType::F16;

  std::string_view name() const { return placement->tensor.name; }
  uint64_t size_bytes() const { return row_bytes * rows; }
  std::span<std::byte> bytes() const { return {base, size_bytes()}; }
  // Row `index` (< rows): for K, token cell `index` of stream 0 (position-major).
  std::span<std::byte> row(uint64_t index) const { return {base + index * row_bytes, row_bytes}; }
};

// The view of `tensor` (an element of layout.tensors) given each chunk's mapped bytes, in
// fd order. Fails with EINVAL when the chunk is missing or the tensor does not fit in it.
Result<TensorView> tensor_view(const layout::SharedTensor& tensor, std::span<const std::span<std::byte>> chunks);

// The tensor named `name` ("cache_v_l12"); ENOENT naming the tensor when the layout has none.
Result<TensorView> tensor_view(const layout::ShareLayout& layout, std::span<const std::span<std::byte>> chunks,
                               std::string_view name);

// The K and V views of layer `il` of cache object `cache_index`: where a provider scatters
// a token's K row and V row (two destinations at two offsets). `v` is absent for MLA.
struct LayerDestination {
  uint32_t il = 0;
  TensorView k;
  TensorView v;
  bool has_v = false;
};
Result<LayerDestination> layer_destination(const layout::ShareLayout& layout,
                                           std::span<const std::span<std::byte>> chunks, uint32_t cache_index,
                                           uint32_t il);

}  // namespace kvshare
