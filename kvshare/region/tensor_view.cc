#include "kvshare/region/tensor_view.h"

#include <cerrno>

namespace kvshare {

Result<TensorView> tensor_view(const layout::SharedTensor& tensor, std::span<const std::span<std::byte>> chunks) {
  const auto& name = tensor.tensor.name;
  if (tensor.chunk >= chunks.size())
    return fail(EINVAL, "tensor {}: chunk {} is not mapped ({} chunks)", name, tensor.chunk, chunks.size());
  const auto chunk = chunks[tensor.chunk];
  const uint64_t row_bytes = tensor.tensor.row_bytes;
  const uint64_t nbytes = tensor.tensor.nbytes;
  // A row of 0 bytes is a state of width 0 (LFM2's cache_s_l<il>: no SSM state), a tensor of
  // no bytes; any other tensor holds whole rows.
  if (row_bytes == 0 ? nbytes != 0 : nbytes % row_bytes != 0)
    return fail(EINVAL, "tensor {}: {} bytes is not a whole number of {}-byte rows", name, nbytes, row_bytes);
  if (tensor.offset > chunk.size() || nbytes > chunk.size() - tensor.offset)
    return fail(EINVAL, "tensor {}: bytes [{}, {}) lie outside chunk {} ({} bytes)", name, tensor.offset,
                tensor.offset + nbytes, tensor.chunk, chunk.size());
  TensorView view;
  view.placement = &tensor;
  view.base = chunk.data() + tensor.offset;
  view.row_bytes = row_bytes;
  view.rows = static_cast<uint64_t>(tensor.tensor.ne[1] * tensor.tensor.ne[2] * tensor.tensor.ne[3]);
  view.type = tensor.tensor.type;
  return view;
}

Result<TensorView> tensor_view(const layout::ShareLayout& layout, std::span<const std::span<std::byte>> chunks,
                               std::string_view name) {
  for (const auto& tensor : layout.tensors)
    if (tensor.tensor.name == name) return tensor_view(tensor, chunks);
  return fail(ENOENT, "the share layout has no tensor named {}", name);
}

Result<LayerDestination> layer_destination(const layout::ShareLayout& layout,
                                           std::span<const std::span<std::byte>> chunks, uint32_t cache_index,
                                           uint32_t il) {
  const layout::SharedTensor* k = nullptr;
  const layout::SharedTensor* v = nullptr;
  for (const auto& tensor : layout.tensors) {
    if (tensor.cache_index != cache_index || tensor.tensor.layer != il) continue;
    if (tensor.tensor.kind == layout::TensorKind::k) k = &tensor;
    if (tensor.tensor.kind == layout::TensorKind::v) v = &tensor;
  }
  if (k == nullptr) return fail(ENOENT, "cache {} has no K tensor for layer {}", cache_index, il);
  LayerDestination destination;
  destination.il = il;
  auto k_view = tensor_view(*k, chunks);
  if (!k_view) return fail(k_view.error());
  destination.k = *k_view;
  if (v != nullptr) {
    auto v_view = tensor_view(*v, chunks);
    if (!v_view) return fail(v_view.error());
    destination.v = *v_view;
    destination.has_v = true;
  }
  return destination;
}

}  // namespace kvshare
