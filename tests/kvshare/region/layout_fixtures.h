// Small hand-built share layouts for the region, handshake and share tests: two layers of
// K and V, f16, placed the way share_layout places them (4096-aligned, chunk order).
#pragma once

#include <string>

#include "layout/share_layout.h"

namespace kvshare::testing {

// `n_layer` layers of cache_k_l<il>/cache_v_l<il>, [n_embd_gqa, kv_size] f16 each, split
// into chunks of at most `tensors_per_chunk` tensors.
inline layout::ShareLayout small_share_layout(uint32_t n_layer = 2, uint32_t kv_size = 256, uint32_t n_embd_gqa = 64,
                                              uint32_t tensors_per_chunk = 64) {
  layout::ShareLayout share;
  uint32_t in_chunk = 0;
  for (uint32_t il = 0; il < n_layer; ++il) {
    for (auto kind : {layout::TensorKind::k, layout::TensorKind::v}) {
      if (share.chunks.empty() || in_chunk == tensors_per_chunk) {
        share.chunks.push_back({0, 0, 0x1000 + share.chunks.size()});
        in_chunk = 0;
      }
      layout::SharedTensor tensor;
      tensor.tensor.name = std::string(kind == layout::TensorKind::k ? "cache_k_l" : "cache_v_l") + std::to_string(il);
      tensor.tensor.layer = il;
      tensor.tensor.kind = kind;
      tensor.tensor.type = layout::GgmlType::F16;
      tensor.tensor.ne = {n_embd_gqa, kv_size, 1, 1};
      tensor.tensor.row_bytes = uint64_t{n_embd_gqa} * 2;
      tensor.tensor.nbytes = tensor.tensor.row_bytes * kv_size;
      tensor.chunk = static_cast<uint32_t>(share.chunks.size() - 1);
      tensor.offset = share.chunks.back().size_bytes;
      tensor.padded_bytes = (tensor.tensor.nbytes + 4095) / 4096 * 4096;
      share.chunks.back().size_bytes += tensor.padded_bytes;
      share.tensors.push_back(tensor);
      ++in_chunk;
    }
  }
  return share;
}

}  // namespace kvshare::testing
