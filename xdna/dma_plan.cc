#include "xdna/dma_plan.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>

#include "layout/row_convert.h"

namespace kvshare::xdna {
namespace {

using layout::CacheTensor;
using layout::GgmlType;
using Limits = ShimLimits;

constexpr uint32_t kWord = Limits::kWordBytes;

// The largest a <= 1023 dividing `words` with words / a <= 1023, or 0.
uint32_t inner_factor(uint64_t words) {
  for (uint64_t a = std::min<uint64_t>(words, Limits::kMaxInnerSize); a >= 1; --a)
    if (words % a == 0 && words / a <= Limits::kMaxInnerSize) return static_cast<uint32_t>(a);
  return 0;
}

// BDs copying `n_tokens` rows of `row_words` words, read `src_stride` words apart from
// `src_offset`, written contiguously (`dst_stride` words apart) from `dst_offset`. At most
// 1023 tokens per BD; one token per BD when a token stride passes the stride limit.
// Returns the reason when a row cannot be expressed at all.
std::string plan_rows(std::vector<DmaTransfer>& out, uint32_t channel, DmaBuffer destination, uint64_t row_words,
                      uint64_t src_offset, uint64_t src_stride, uint64_t dst_offset, uint64_t dst_stride,
                      uint32_t n_tokens) {
  const bool row_in_one_dim = row_words <= Limits::kMaxInnerSize;
  const uint32_t a = row_in_one_dim ? static_cast<uint32_t>(row_words) : inner_factor(row_words);
  if (a == 0)
    return fmt::format("a row of {} words has no split into two sizes <= {}", row_words, Limits::kMaxInnerSize);
  const auto b = static_cast<uint32_t>(row_words / a);
  const bool strides_fit = src_stride <= Limits::kMaxStrideWords && dst_stride <= Limits::kMaxStrideWords;
  const uint32_t per_bd = strides_fit ? Limits::kMaxInnerSize : 1;
  for (uint32_t t0 = 0; t0 < n_tokens; t0 += per_bd) {
    const uint32_t count = std::min(per_bd, n_tokens - t0);
    DmaTransfer transfer;
    transfer.channel = channel;
    transfer.source = DmaBuffer::rows;
    transfer.destination = destination;
    auto fill = [&](DmaPattern& pattern, uint64_t offset, uint64_t stride) {
      pattern.offset_words = offset + t0 * stride;
      const uint32_t token_stride = count > 1 ? static_cast<uint32_t>(stride) : 0;
      if (row_in_one_dim) {
        pattern.dims = {DmaDim{a, 1}, DmaDim{count, token_stride}, DmaDim{1, 0}};
      } else {
        pattern.dims = {DmaDim{a, 1}, DmaDim{b, a}, DmaDim{count, token_stride}};
      }
    };
    fill(transfer.read, src_offset, src_stride);
    fill(transfer.write, dst_offset, dst_stride);
    out.push_back(transfer);
  }
  return {};
}

// Why a tensor cannot be copied by a DMA as is, or "" when it can.
std::string copy_blocker(const CacheTensor& tensor, GgmlType src_type, bool rotated) {
  if (tensor.type != src_type)
    return fmt::format("{}: the cache is {} and the rows are {}; a shim DMA copies bytes and cannot convert",
                       tensor.name, layout::ggml_type_name(tensor.type), layout::ggml_type_name(src_type));
  if (rotated) return fmt::format("{}: llama.cpp rotates this cache before storing it; a DMA cannot", tensor.name);
  return {};
}

}  // namespace

uint64_t DmaPattern::words() const {
  return static_cast<uint64_t>(dims[0].size) * dims[1].size * dims[2].size * repeat;
}

std::string_view dma_buffer_name(DmaBuffer buffer) {
  switch (buffer) {
    case DmaBuffer::rows:
      return "rows";
    case DmaBuffer::cache_k:
      return "cache_k";
    case DmaBuffer::cache_v:
      return "cache_v";
  }
  return "?";
}

Result<DmaPlan> plan_layer_dma(const ScatterTarget& target, const ScatterBatch& batch) {
  if (batch.layers.size() != 1)
    return fail(EINVAL, "DMA plan: a plan covers one layer, the batch has {}", batch.layers.size());
  if (auto valid = validate_scatter(target, batch); !valid) return fail(valid.error().with_context("DMA plan"));
  const LayerRows& rows = batch.layers[0];
  const layout::KvCacheShape& cache = target.memory.kv_caches[target.cache_index];
  const CacheTensor& k = target.layout.find(target.cache_index, rows.il, layout::TensorKind::k)->tensor;
  const layout::SharedTensor* v_placed = target.layout.find(target.cache_index, rows.il, layout::TensorKind::v);
  const uint64_t es = layout::ggml_row_size(batch.src_type, 1);
  const uint64_t stride_bytes = batch.n_tokens > 1 ? batch.row_stride : (rows.n_embd_k_gqa + rows.n_embd_v_gqa) * es;

  DmaPlan plan;
  // Source addressing is in words: the row stride and the K|V boundary must be whole words.
  if (stride_bytes % kWord != 0 || (rows.n_embd_k_gqa * es) % kWord != 0) {
    plan.cpu_fallback.push_back(
        fmt::format("layer {}: row stride {} bytes or K part {} bytes is not a whole number of 32-bit words", rows.il,
                    stride_bytes, rows.n_embd_k_gqa * es));
    return plan;
  }
  const uint64_t src_stride = stride_bytes / kWord;
  const uint64_t k_words = rows.n_embd_k_gqa * es / kWord;
  const uint64_t first_cell = static_cast<uint64_t>(batch.stream) * cache.kv_size + batch.pos0;

  // A tensor's descriptors join the plan only if the tile still has room for all of them.
  auto take_if_room = [&plan](const std::string& name, std::vector<DmaTransfer>& transfers) {
    const size_t left = Limits::kBdsPerTile - plan.transfers.size();
    if (transfers.size() > left) {
      plan.cpu_fallback.push_back(fmt::format("{}: needs {} buffer descriptors, the shim tile has {} left of {}", name,
                                              transfers.size(), left, Limits::kBdsPerTile));
      return false;
    }
    plan.transfers.insert(plan.transfers.end(), transfers.begin(), transfers.end());
    return true;
  };

  const bool k_rotated = !batch.rotation_disabled &&
                         layout::kv_rotation_group(layout::TensorKind::k, k.type, target.n_embd_head_k, false) > 0;
  std::vector<DmaTransfer> k_transfers;
  if (std::string why = copy_blocker(k, batch.src_type, k_rotated); !why.empty()) {
    plan.cpu_fallback.push_back(why);
  } else if (std::string why_rows = plan_rows(k_transfers, 0, DmaBuffer::cache_k, k_words, 0, src_stride,
                                              first_cell * k_words, k_words, batch.n_tokens);
             !why_rows.empty()) {
    plan.cpu_fallback.push_back(k.name + ": " + why_rows);
  } else {
    plan.covers_k = take_if_room(k.name, k_transfers);
  }

  if (v_placed == nullptr) return plan;
  const CacheTensor& v = v_placed->tensor;
  const bool v_rotated = !batch.rotation_disabled &&
                         layout::kv_rotation_group(layout::TensorKind::v, v.type, target.n_embd_head_v, false) > 0;
  if (std::string why = copy_blocker(v, batch.src_type, v_rotated); !why.empty()) {
    plan.cpu_fallback.push_back(why);
    return plan;
  }
  // Whole words only: a V row of 66 bytes would lose its last 2 (the shim DMA moves words).
  if ((rows.n_embd_v_gqa * es) % kWord != 0) {
    plan.cpu_fallback.push_back(
        fmt::format("{}: a V row of {} bytes is not a whole number of 32-bit words", v.name, rows.n_embd_v_gqa * es));
    return plan;
  }
  const uint64_t v_words = rows.n_embd_v_gqa * es / kWord;
  std::vector<DmaTransfer> v_transfers;
  if (!cache.v_trans) {
    if (std::string why = plan_rows(v_transfers, 1, DmaBuffer::cache_v, v_words, k_words, src_stride,
                                    first_cell * v_words, v_words, batch.n_tokens);
        !why.empty())
      plan.cpu_fallback.push_back(v.name + ": " + why);
    else
      plan.covers_v = take_if_room(v.name, v_transfers);
    return plan;
  }

  // Transposed V: element j of cell c at element j*kv_size + c of the stream's block.
  if (es != kWord) {
    plan.cpu_fallback.push_back(fmt::format(
        "{}: transposed V of {}-byte {} elements: each cell owns half a 32-bit word in an element row, and the "
        "shim DMA addresses whole words only",
        v.name, es, layout::ggml_type_name(v.type)));
    return plan;
  }
  const auto v_width = static_cast<uint64_t>(v.ne[0]);
  if (v_width != rows.n_embd_v_gqa) {
    plan.cpu_fallback.push_back(
        fmt::format("{}: rows {}..{} of the transposed V need the zeros llama.cpp pads with, and no source holds them",
                    v.name, rows.n_embd_v_gqa, v_width - 1));
    return plan;
  }
  if (cache.kv_size > Limits::kMaxStrideWords) {
    plan.cpu_fallback.push_back(fmt::format("{}: kv_size {} passes the stride limit of {} words", v.name, cache.kv_size,
                                            Limits::kMaxStrideWords));
    return plan;
  }
  const uint64_t stream_base = static_cast<uint64_t>(batch.stream) * v_width * cache.kv_size;
  const uint32_t tokens_per_bd = src_stride <= Limits::kMaxStrideWords ? Limits::kMaxInnerSize : 1;
  for (uint32_t t0 = 0; t0 < batch.n_tokens; t0 += tokens_per_bd) {
    const uint32_t count = std::min(tokens_per_bd, batch.n_tokens - t0);
    for (uint64_t j0 = 0; j0 < v_width; j0 += Limits::kMaxInnerSize) {
      const auto rows_here = static_cast<uint32_t>(std::min<uint64_t>(Limits::kMaxInnerSize, v_width - j0));
      DmaTransfer transfer;
      transfer.channel = 1;
      transfer.destination = DmaBuffer::cache_v;
      // Stream order: cells fastest, then element rows, so each write run is contiguous.
      transfer.read.offset_words = t0 * src_stride + k_words + j0;
      transfer.read.dims = {DmaDim{count, count > 1 ? static_cast<uint32_t>(src_stride) : 0}, DmaDim{rows_here, 1},
                            DmaDim{1, 0}};
      transfer.write.offset_words = stream_base + j0 * cache.kv_size + batch.pos0 + t0;
      transfer.write.dims = {DmaDim{count, 1}, DmaDim{rows_here, cache.kv_size}, DmaDim{1, 0}};
      v_transfers.push_back(transfer);
    }
  }
  plan.covers_v = take_if_room(v.name, v_transfers);
  return plan;
}

namespace {

Result<void> check_pattern(const DmaPattern& pattern, size_t transfer, const char* side, uint64_t buffer_bytes,
                           DmaBuffer buffer) {
  for (int d = 0; d < 3; ++d) {
    if (pattern.dims[d].size == 0)
      return fail(EINVAL, "DMA transfer {} {}: dimension {} has size 0", transfer, side, d);
    if (d < 2 && pattern.dims[d].size > Limits::kMaxInnerSize)
      return fail(EINVAL, "DMA transfer {} {}: dimension {} size {} passes the shim limit {}", transfer, side, d,
                  pattern.dims[d].size, Limits::kMaxInnerSize);
    if (pattern.dims[d].stride > Limits::kMaxStrideWords)
      return fail(EINVAL, "DMA transfer {} {}: dimension {} stride {} words passes the shim limit {:#x}", transfer,
                  side, d, pattern.dims[d].stride, Limits::kMaxStrideWords);
  }
  if (pattern.repeat == 0 || pattern.repeat > Limits::kMaxRepeat)
    return fail(EINVAL, "DMA transfer {} {}: repeat {} outside 1..{}", transfer, side, pattern.repeat,
                Limits::kMaxRepeat);
  if (pattern.repeat_stride > Limits::kMaxStrideWords)
    return fail(EINVAL, "DMA transfer {} {}: repeat stride {} words passes the shim limit {:#x}", transfer, side,
                pattern.repeat_stride, Limits::kMaxStrideWords);
  uint64_t last = pattern.offset_words + static_cast<uint64_t>(pattern.repeat - 1) * pattern.repeat_stride;
  for (const DmaDim& dim : pattern.dims) last += static_cast<uint64_t>(dim.size - 1) * dim.stride;
  if ((last + 1) * kWord > buffer_bytes)
    return fail(EINVAL, "DMA transfer {} {}: reaches word {} of {} ({} bytes)", transfer, side, last,
                dma_buffer_name(buffer), buffer_bytes);
  return {};
}

template <class Visit>
void for_each_word(const DmaPattern& p, Visit&& visit) {
  for (uint32_t r = 0; r < p.repeat; ++r)
    for (uint32_t k = 0; k < p.dims[2].size; ++k)
      for (uint32_t j = 0; j < p.dims[1].size; ++j)
        for (uint32_t i = 0; i < p.dims[0].size; ++i)
          visit(p.offset_words + static_cast<uint64_t>(r) * p.repeat_stride +
                static_cast<uint64_t>(k) * p.dims[2].stride + static_cast<uint64_t>(j) * p.dims[1].stride +
                static_cast<uint64_t>(i) * p.dims[0].stride);
}

}  // namespace

Result<void> simulate_dma(const DmaPlan& plan, std::span<const std::byte> rows, std::span<std::byte> cache_k,
                          std::span<std::byte> cache_v) {
  auto size_of = [&](DmaBuffer buffer) -> uint64_t {
    return buffer == DmaBuffer::rows ? rows.size() : buffer == DmaBuffer::cache_k ? cache_k.size() : cache_v.size();
  };
  std::map<uint32_t, size_t> bds_per_tile;
  for (size_t i = 0; i < plan.transfers.size(); ++i) {
    const DmaTransfer& t = plan.transfers[i];
    if (++bds_per_tile[t.shim_tile] > Limits::kBdsPerTile)
      return fail(EINVAL, "DMA transfer {}: shim tile {} has only {} buffer descriptors", i, t.shim_tile,
                  Limits::kBdsPerTile);
    if (t.channel >= Limits::kChannelsPerDirection)
      return fail(EINVAL, "DMA transfer {}: channel {} but a shim tile has {} per direction", i, t.channel,
                  Limits::kChannelsPerDirection);
    if (t.source != DmaBuffer::rows || t.destination == DmaBuffer::rows)
      return fail(EINVAL, "DMA transfer {}: reads {} and writes {}; a scatter reads rows and writes the cache", i,
                  dma_buffer_name(t.source), dma_buffer_name(t.destination));
    if (t.read.words() != t.write.words())
      return fail(EINVAL, "DMA transfer {}: reads {} words but writes {}", i, t.read.words(), t.write.words());
    if (auto r = check_pattern(t.read, i, "read", size_of(t.source), t.source); !r) return r;
    if (auto r = check_pattern(t.write, i, "write", size_of(t.destination), t.destination); !r) return r;
  }
  for (const DmaTransfer& t : plan.transfers) {
    std::vector<uint64_t> stream;
    stream.reserve(t.read.words());
    for_each_word(t.read, [&](uint64_t word) { stream.push_back(word); });
    std::byte* dst = t.destination == DmaBuffer::cache_k ? cache_k.data() : cache_v.data();
    size_t n = 0;
    for_each_word(t.write,
                  [&](uint64_t word) { std::memcpy(dst + word * kWord, rows.data() + stream[n++] * kWord, kWord); });
  }
  return {};
}

}  // namespace kvshare::xdna
