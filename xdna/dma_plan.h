// One layer's scatter as AIE shim-DMA buffer descriptors, and a simulator that executes
// a plan with memcpy while enforcing every limit the hardware has.
//
// The limits are the AIE2 shim BD's, as mlir-aie's npu.dma_memcpy_nd verifies them: a
// 4-D pattern of three size/stride pairs plus an outer repeat, all in 32-bit words; the
// two inner sizes at most 1023, the repeat at most 64, every stride at most 0xFFFFF words
// (about 4 MiB); offsets and inner lengths whole words; 2 MM2S (read) and 2 S2MM (write)
// channels per shim tile. A shim DMA copies bytes: it cannot convert types or rotate, and
// it cannot write a value no source holds (the zero padding of a narrower transposed V).
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvshare/scatter/scatter.h"
#include "layout/error.h"

namespace kvshare::xdna {

struct ShimLimits {
  static constexpr uint32_t kMaxInnerSize = 1023;  // dims 0 and 1
  static constexpr uint32_t kMaxRepeat = 64;       // the outer iteration count
  static constexpr uint32_t kMaxStrideWords = 0xFFFFF;
  static constexpr uint32_t kWordBytes = 4;
  static constexpr uint32_t kChannelsPerDirection = 2;  // per shim tile
  // Buffer descriptors per shim tile (AIE2: 16, shared by its channels). A plan runs as one
  // sequence without reprogramming a descriptor, so this bounds its transfers per tile.
  static constexpr uint32_t kBdsPerTile = 16;
};

struct DmaDim {
  uint32_t size = 1;    // iterations
  uint32_t stride = 0;  // words between iterations
};

// Addresses, innermost first: for r < repeat, k < dims[2], j < dims[1], i < dims[0]:
// offset + r*repeat_stride + k*dims[2].stride + j*dims[1].stride + i*dims[0].stride.
struct DmaPattern {
  uint64_t offset_words = 0;
  std::array<DmaDim, 3> dims{};
  uint32_t repeat = 1;
  uint32_t repeat_stride = 0;
  uint64_t words() const;
};

enum class DmaBuffer : uint8_t { rows, cache_k, cache_v };
std::string_view dma_buffer_name(DmaBuffer buffer);

// One BD pair: an MM2S channel streams `read` out of `source`, the matching S2MM channel
// writes the same words in the same order through `write` into `destination`.
struct DmaTransfer {
  uint32_t shim_tile = 0;
  uint32_t channel = 0;  // < kChannelsPerDirection
  DmaBuffer source = DmaBuffer::rows;
  DmaPattern read;
  DmaBuffer destination = DmaBuffer::cache_k;
  DmaPattern write;
};

struct DmaPlan {
  std::vector<DmaTransfer> transfers;
  // Tensors no plan can write, with the reason; the CPU scatter does those.
  std::vector<std::string> cpu_fallback;
  bool covers_k = false;
  bool covers_v = false;
};

// Plans the scatter of `batch`'s single layer into `target` (same validation as scatter).
// Destination offsets are relative to the start of cache_k_l<il> / cache_v_l<il>; source
// offsets to the layer's row pointer. A tensor whose type differs from the source type,
// that is rotated, whose rows are not whole words, that is a transposed V of 2-byte
// elements, or that would need more buffer descriptors than the shim tile has left is
// left to the CPU with the reason in cpu_fallback (and covers_k / covers_v false).
Result<DmaPlan> plan_layer_dma(const ScatterTarget& target, const ScatterBatch& batch);

// Executes `plan` with memcpy: checks every transfer against ShimLimits (the descriptors
// per shim tile included) and every address against its buffer before copying anything, then copies word by word in
// stream order. Fails with EINVAL naming the transfer and the limit or bound it breaks.
Result<void> simulate_dma(const DmaPlan& plan, std::span<const std::byte> rows, std::span<std::byte> cache_k,
                          std::span<std::byte> cache_v);

}  // namespace kvshare::xdna
