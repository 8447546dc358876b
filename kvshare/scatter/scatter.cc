#include "kvshare/scatter/scatter.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "layout/row_convert.h"

namespace kvshare {
namespace {

using layout::CacheTensor;
using layout::GgmlType;
using layout::TensorKind;

// Everything one layer's writes need, resolved and checked before any byte is written.
struct LayerPlan {
  uint32_t il = 0;
  const std::byte* src = nullptr;  // token 0's row
  uint32_t n_embd_k = 0;
  uint32_t n_embd_v = 0;
  const CacheTensor* k = nullptr;
  std::byte* k_stream = nullptr;   // cell 0 of the stream in cache_k_l<il>
  const CacheTensor* v = nullptr;  // nullptr for a K-only layer
  std::byte* v_stream = nullptr;
  // Set when the tensor's chunk is written through its descriptor: where cell 0 of the
  // stream sits inside the chunk.
  const ChunkFile* k_file = nullptr;
  uint64_t k_stream_offset = 0;
  const ChunkFile* v_file = nullptr;
  uint64_t v_stream_offset = 0;
  int rotation_k = 0;
  int rotation_v = 0;
};

struct CachePlan {
  const layout::KvCacheShape* cache = nullptr;
  std::vector<LayerPlan> layers;
};

// The tensor's bytes inside its chunk's mapping, checked against the layout.
Result<std::byte*> tensor_base(const ScatterTarget& target, const layout::SharedTensor& placed) {
  if (placed.chunk >= target.chunks.size())
    return fail(EINVAL, "{} lives in chunk {}, but only {} chunk mapping(s) were given", placed.tensor.name,
                placed.chunk, target.chunks.size());
  const std::span<std::byte> chunk = target.chunks[placed.chunk];
  if (chunk.size() < placed.offset + placed.tensor.nbytes)
    return fail(EINVAL, "{} needs bytes {}..{} of chunk {}, whose mapping has {} bytes", placed.tensor.name,
                placed.offset, placed.offset + placed.tensor.nbytes, placed.chunk, chunk.size());
  return chunk.data() + placed.offset;
}

// The descriptor to write `placed` through, or nullptr for the mapping.
Result<const ChunkFile*> tensor_file(const ScatterTarget& target, const layout::SharedTensor& placed) {
  if (target.chunk_files.empty()) return nullptr;
  if (target.chunk_files.size() != target.chunks.size())
    return fail(EINVAL, "{} chunk descriptors for {} chunk mappings (one per chunk, in fd order)",
                target.chunk_files.size(), target.chunks.size());
  const ChunkFile& file = target.chunk_files[placed.chunk];
  return file.writable() ? &file : nullptr;
}

// The rotation llama.cpp applies to this tensor; an error when the head size it depends
// on was not given.
Result<int> rotation_for(const CacheTensor& tensor, uint32_t n_embd_head, uint32_t width, bool disabled) {
  if (disabled || !layout::is_quantized(tensor.type)) return 0;
  if (n_embd_head == 0)
    return fail(EINVAL,
                "{} is {}: llama.cpp rotates quantized caches by head, but ScatterTarget::n_embd_head_{} is 0 "
                "(set the head size, or set rotation_disabled when the decoder runs with LLAMA_ATTN_ROT_DISABLE=1)",
                tensor.name, layout::ggml_type_name(tensor.type), layout::tensor_kind_name(tensor.kind));
  const int group = layout::kv_rotation_group(tensor.kind, tensor.type, n_embd_head, false);
  if (group > 0 && width % static_cast<uint32_t>(group) != 0)
    return fail(EINVAL, "{}: width {} is not a multiple of the rotation group {} (head size {})", tensor.name, width,
                group, n_embd_head);
  return group;
}

Result<void> check_positions(const layout::KvCacheShape& cache, const CacheTensor& tensor, uint32_t pos0,
                             uint32_t n_tokens, uint32_t stream) {
  if (static_cast<uint64_t>(pos0) + n_tokens > cache.kv_size)
    return fail(EINVAL, "layer {} {}: positions {}..{} pass kv_size {}", tensor.layer, tensor.name, pos0,
                static_cast<uint64_t>(pos0) + n_tokens - 1, cache.kv_size);
  if (stream >= cache.n_stream)
    return fail(EINVAL, "layer {} {}: stream {} but the cache has {} stream(s)", tensor.layer, tensor.name, stream,
                cache.n_stream);
  if (tensor.ne[1] != cache.kv_size || tensor.ne[2] != cache.n_stream)
    return fail(EINVAL, "layer {} {}: shape [{}, {}, {}] does not match kv_size {} x {} stream(s)", tensor.layer,
                tensor.name, tensor.ne[0], tensor.ne[1], tensor.ne[2], cache.kv_size, cache.n_stream);
  return {};
}

const layout::KvCacheShape* find_cache(const ScatterTarget& target) {
  if (target.cache_index >= target.memory.kv_caches.size()) return nullptr;
  return &target.memory.kv_caches[target.cache_index];
}

// Resolves one layer: tensors, stream bases, widths and rotation.
Result<LayerPlan> plan_layer(const ScatterTarget& target, const layout::KvCacheShape& cache, uint32_t il,
                             uint32_t n_embd_k, uint32_t n_embd_v, uint32_t pos0, uint32_t n_tokens, uint32_t stream,
                             bool rotation_disabled) {
  LayerPlan plan;
  plan.il = il;
  plan.n_embd_k = n_embd_k;
  plan.n_embd_v = n_embd_v;
  const layout::SharedTensor* k = target.layout.find(target.cache_index, il, TensorKind::k);
  if (k == nullptr)
    return fail(EINVAL, "layer {}: the share layout has no cache_k_l{} in cache {} ({})", il, il, target.cache_index,
                cache.role);
  plan.k = &k->tensor;
  if (auto r = check_positions(cache, k->tensor, pos0, n_tokens, stream); !r) return fail(r.error());
  if (k->tensor.ne[0] != n_embd_k)
    return fail(EINVAL, "layer {} {}: the provider's rows carry {} K values, the cache holds {}", il, k->tensor.name,
                n_embd_k, k->tensor.ne[0]);
  auto k_base = tensor_base(target, *k);
  if (!k_base) return fail(k_base.error());
  plan.k_stream = *k_base + static_cast<uint64_t>(stream) * cache.kv_size * k->tensor.row_bytes;
  auto k_file = tensor_file(target, *k);
  if (!k_file) return fail(k_file.error());
  plan.k_file = *k_file;
  plan.k_stream_offset = k->offset + static_cast<uint64_t>(stream) * cache.kv_size * k->tensor.row_bytes;
  auto rot_k = rotation_for(k->tensor, target.n_embd_head_k, n_embd_k, rotation_disabled);
  if (!rot_k) return fail(rot_k.error());
  plan.rotation_k = *rot_k;

  const layout::SharedTensor* v = target.layout.find(target.cache_index, il, TensorKind::v);
  if (v == nullptr) {
    if (n_embd_v != 0)
      return fail(EINVAL, "layer {}: the provider's rows carry {} V values but the cache has no cache_v_l{}", il,
                  n_embd_v, il);
    return plan;
  }
  plan.v = &v->tensor;
  if (auto r = check_positions(cache, v->tensor, pos0, n_tokens, stream); !r) return fail(r.error());
  if (cache.v_trans) {
    if (layout::is_quantized(v->tensor.type))
      return fail(EINVAL, "layer {} {}: a transposed V cannot be {} (llama.cpp needs flash attention for that)", il,
                  v->tensor.name, layout::ggml_type_name(v->tensor.type));
    if (n_embd_v == 0 || v->tensor.ne[0] < n_embd_v)
      return fail(EINVAL, "layer {} {}: the provider's rows carry {} V values, the transposed cache is {} wide", il,
                  v->tensor.name, n_embd_v, v->tensor.ne[0]);
  } else if (v->tensor.ne[0] != n_embd_v) {
    return fail(EINVAL, "layer {} {}: the provider's rows carry {} V values, the cache holds {}", il, v->tensor.name,
                n_embd_v, v->tensor.ne[0]);
  }
  auto v_base = tensor_base(target, *v);
  if (!v_base) return fail(v_base.error());
  plan.v_stream = *v_base + static_cast<uint64_t>(stream) * cache.kv_size * v->tensor.row_bytes;
  if (!cache.v_trans) {
    auto v_file = tensor_file(target, *v);
    if (!v_file) return fail(v_file.error());
    plan.v_file = *v_file;
    plan.v_stream_offset = v->offset + static_cast<uint64_t>(stream) * cache.kv_size * v->tensor.row_bytes;
  }
  auto rot_v = rotation_for(v->tensor, target.n_embd_head_v, n_embd_v, rotation_disabled);
  if (!rot_v) return fail(rot_v.error());
  plan.rotation_v = *rot_v;
  return plan;
}

Result<CachePlan> plan_scatter(const ScatterTarget& target, const ScatterBatch& batch) {
  CachePlan plan;
  plan.cache = find_cache(target);
  if (plan.cache == nullptr)
    return fail(EINVAL, "scatter: cache index {} but the memory has {} KV cache(s)", target.cache_index,
                target.memory.kv_caches.size());
  if (!layout::is_source_type(batch.src_type))
    return fail(EINVAL, "scatter: source rows are {}; a provider hands f32, f16 or bf16",
                layout::ggml_type_name(batch.src_type));
  const uint64_t element_bytes = layout::ggml_row_size(batch.src_type, 1);
  std::vector<uint32_t> seen;
  for (const LayerRows& rows : batch.layers) {
    if (std::find(seen.begin(), seen.end(), rows.il) != seen.end())
      return fail(EINVAL, "scatter: layer {} appears twice in one batch", rows.il);
    seen.push_back(rows.il);
    if (rows.data == nullptr && batch.n_tokens > 0) return fail(EINVAL, "scatter: layer {} has no row data", rows.il);
    const uint64_t row_bytes = (static_cast<uint64_t>(rows.n_embd_k_gqa) + rows.n_embd_v_gqa) * element_bytes;
    if (batch.n_tokens > 1 && batch.row_stride < row_bytes)
      return fail(EINVAL,
                  "scatter: layer {}: row stride {} bytes is shorter than one {} row of {} + {} values ({} bytes)",
                  rows.il, batch.row_stride, layout::ggml_type_name(batch.src_type), rows.n_embd_k_gqa,
                  rows.n_embd_v_gqa, row_bytes);
    auto layer = plan_layer(target, *plan.cache, rows.il, rows.n_embd_k_gqa, rows.n_embd_v_gqa, batch.pos0,
                            batch.n_tokens, batch.stream, batch.rotation_disabled);
    if (!layer) return fail(layer.error().with_context("scatter"));
    layer->src = static_cast<const std::byte*>(rows.data);
    plan.layers.push_back(*layer);
  }
  return plan;
}

// Tokens per work item: small enough to share a layer between threads, large enough that
// the per-item overhead (and the transposed-V tile) stays negligible.
constexpr uint32_t kTokensPerItem = 256;
// Tokens converted together before a transposed V is written out column by column.
constexpr uint32_t kTransposeTile = 64;

// Converts tokens [t0, t1) of one position-major tensor into `staging` (the provider's own,
// warm memory) and writes them to the chunk with one pwrite().
Result<void> write_rows_through_file(const LayerPlan& layer, const CacheTensor& tensor, const ChunkFile& file,
                                     uint64_t stream_offset, uint64_t src_offset, uint32_t n_embd, int rotation,
                                     const ScatterBatch& batch, uint32_t t0, uint32_t t1,
                                     std::vector<std::byte>& staging) {
  staging.resize(static_cast<size_t>(t1 - t0) * tensor.row_bytes);
  for (uint32_t t = t0; t < t1; ++t) {
    const std::byte* row = layer.src + static_cast<uint64_t>(t) * batch.row_stride + src_offset;
    layout::convert_row(batch.src_type, row, tensor.type,
                        staging.data() + static_cast<size_t>(t - t0) * tensor.row_bytes, n_embd, rotation);
  }
  auto written =
      write_chunk_file(file, stream_offset + static_cast<uint64_t>(batch.pos0 + t0) * tensor.row_bytes, staging);
  if (!written) return fail(written.error().with_context(fmt::format("scatter of layer {} {}", layer.il, tensor.name)));
  return {};
}

// Writes tokens [t0, t1) of one layer.
Result<void> scatter_range(const CachePlan& plan, const LayerPlan& layer, const ScatterBatch& batch, uint32_t t0,
                           uint32_t t1, std::vector<std::byte>& tile) {
  const layout::KvCacheShape& cache = *plan.cache;
  const uint64_t element_bytes = layout::ggml_row_size(batch.src_type, 1);
  const uint64_t v_src_offset = layer.n_embd_k * element_bytes;
  const bool v_by_mapping = layer.v != nullptr && !cache.v_trans && layer.v_file == nullptr;
  if (layer.k_file != nullptr) {
    auto k = write_rows_through_file(layer, *layer.k, *layer.k_file, layer.k_stream_offset, 0, layer.n_embd_k,
                                     layer.rotation_k, batch, t0, t1, tile);
    if (!k) return k;
  }
  if (layer.v_file != nullptr) {
    auto v = write_rows_through_file(layer, *layer.v, *layer.v_file, layer.v_stream_offset, v_src_offset,
                                     layer.n_embd_v, layer.rotation_v, batch, t0, t1, tile);
    if (!v) return v;
  }
  if (layer.k_file == nullptr || v_by_mapping) {
    for (uint32_t t = t0; t < t1; ++t) {
      const std::byte* row = layer.src + static_cast<uint64_t>(t) * batch.row_stride;
      // Streaming stores: the decoder reads these rows later, from another process; caching
      // them here would only evict the provider's own working set.
      if (layer.k_file == nullptr)
        layout::convert_row_streaming(batch.src_type, row, layer.k->type,
                                      layer.k_stream + static_cast<uint64_t>(batch.pos0 + t) * layer.k->row_bytes,
                                      layer.n_embd_k, layer.rotation_k);
      if (v_by_mapping)
        layout::convert_row_streaming(batch.src_type, row + v_src_offset, layer.v->type,
                                      layer.v_stream + static_cast<uint64_t>(batch.pos0 + t) * layer.v->row_bytes,
                                      layer.n_embd_v, layer.rotation_v);
    }
    layout::convert_stream_fence();
  }
  if (layer.v == nullptr || !cache.v_trans) return {};

  // Transposed V: convert a tile of rows, then write each of the v_width element rows of
  // the tensor as one contiguous run of cells.
  const uint64_t dst_element = layout::ggml_row_size(layer.v->type, 1);
  const uint64_t v_width = static_cast<uint64_t>(layer.v->ne[0]);
  const uint64_t tile_row_bytes = layer.n_embd_v * dst_element;
  tile.resize(kTransposeTile * tile_row_bytes);
  for (uint32_t a = t0; a < t1; a += kTransposeTile) {
    const uint32_t count = std::min(kTransposeTile, t1 - a);
    for (uint32_t i = 0; i < count; ++i) {
      const std::byte* row = layer.src + static_cast<uint64_t>(a + i) * batch.row_stride;
      layout::convert_row(batch.src_type, row + v_src_offset, layer.v->type, tile.data() + i * tile_row_bytes,
                          layer.n_embd_v, 0);
    }
    const uint64_t cell0 = batch.pos0 + a;
    for (uint64_t j = 0; j < v_width; ++j) {
      std::byte* dst = layer.v_stream + (j * cache.kv_size + cell0) * dst_element;
      if (j >= layer.n_embd_v) {
        std::memset(dst, 0, count * dst_element);  // ggml_pad's zeros for a narrower layer
      } else if (dst_element == 2) {
        for (uint32_t i = 0; i < count; ++i) std::memcpy(dst + i * 2, tile.data() + i * tile_row_bytes + j * 2, 2);
      } else {
        for (uint32_t i = 0; i < count; ++i)
          std::memcpy(dst + i * dst_element, tile.data() + i * tile_row_bytes + j * dst_element, dst_element);
      }
    }
  }
  return {};
}

// The cache_r_l<il> or cache_s_l<il> placement, or an error with `missing_errno` when the
// layer has no recurrent state (state_width's ENOENT, write_state's EINVAL).
Result<const layout::SharedTensor*> find_state_tensor(const layout::ShareLayout& layout,
                                                      const layout::MemoryShape& memory, uint32_t il, TensorKind kind,
                                                      int missing_errno) {
  if (kind != TensorKind::r && kind != TensorKind::s)
    return fail(EINVAL, "layer {}: state kind {} is not r (conv history) or s (SSM state)", il,
                layout::tensor_kind_name(kind));
  if (!memory.recurrent)
    return fail(missing_errno, "layer {}: the memory ({}) has no recurrent state", il,
                layout::memory_kind_name(memory.kind));
  const auto& layers = memory.recurrent->layers;
  if (std::none_of(layers.begin(), layers.end(), [&](const layout::RecurrentLayer& l) { return l.il == il; })) {
    std::string recurrent;
    for (const auto& l : layers) recurrent += fmt::format("{}{}", recurrent.empty() ? "" : ", ", l.il);
    return fail(missing_errno, "layer {} has no cache_{}_l{}: it is not one of the {} recurrent layer(s) ({})", il,
                layout::tensor_kind_name(kind), il, layers.size(), recurrent);
  }
  const auto cache_index = static_cast<uint32_t>(memory.kv_caches.size());  // the recurrent cache object
  const layout::SharedTensor* placed = layout.find(cache_index, il, kind);
  if (placed == nullptr)
    return fail(missing_errno, "layer {}: the share layout has no cache_{}_l{} in cache {} (recurrent)", il,
                layout::tensor_kind_name(kind), il, cache_index);
  return placed;
}

}  // namespace

Result<uint64_t> state_width(const layout::ShareLayout& layout, const layout::MemoryShape& memory, uint32_t il,
                             TensorKind kind) {
  auto placed = find_state_tensor(layout, memory, il, kind, ENOENT);
  if (!placed) return fail(placed.error());
  return static_cast<uint64_t>((*placed)->tensor.ne[0]);
}

Result<void> write_state(const ScatterTarget& target, const StateRow& row) {
  auto found = find_state_tensor(target.layout, target.memory, row.il, row.kind, EINVAL);
  if (!found) return fail(found.error().with_context("write_state"));
  const layout::SharedTensor& placed = **found;
  const CacheTensor& tensor = placed.tensor;
  const uint32_t rs_size = target.memory.recurrent->rs_size;
  if (tensor.type != GgmlType::F32)
    return fail(EINVAL, "write_state: layer {} {} is {}, but recurrent state rows are written as f32", row.il,
                tensor.name, layout::ggml_type_name(tensor.type));
  if (tensor.ne[1] != rs_size)
    return fail(EINVAL, "write_state: layer {} {}: {} rows, but rs_size is {}", row.il, tensor.name, tensor.ne[1],
                rs_size);
  if (row.cell >= rs_size)
    return fail(ERANGE, "write_state: layer {} {}: cell {} is past rs_size {} (one cell per sequence)", row.il,
                tensor.name, row.cell, rs_size);
  const auto width = static_cast<uint64_t>(tensor.ne[0]);
  if (row.values.size() != width)
    return fail(EINVAL,
                "write_state: layer {} {} cell {}: the provider's row carries {} values, the tensor's row "
                "holds {} (n_embd_{})",
                row.il, tensor.name, row.cell, row.values.size(), width, layout::tensor_kind_name(row.kind));
  auto base = tensor_base(target, placed);
  if (!base) return fail(base.error().with_context("write_state"));
  auto file = tensor_file(target, placed);
  if (!file) return fail(file.error().with_context("write_state"));
  if (width == 0) return {};  // LFM2's S: nothing to hold

  const uint64_t row_offset = static_cast<uint64_t>(row.cell) * tensor.row_bytes;
  if (*file != nullptr) {
    auto written = write_chunk_file(**file, placed.offset + row_offset, std::as_bytes(row.values));
    if (!written)
      return fail(written.error().with_context(
          fmt::format("write_state of layer {} {} cell {}", row.il, tensor.name, row.cell)));
    return {};
  }
  // f32 to f32 is a copy; streaming stores for the reason scatter_range gives.
  layout::convert_row_streaming(GgmlType::F32, row.values.data(), GgmlType::F32, *base + row_offset,
                                static_cast<int64_t>(width));
  layout::convert_stream_fence();
  return {};
}

Result<void> scatter(const ScatterTarget& target, const ScatterBatch& batch) {
  auto plan = plan_scatter(target, batch);
  if (!plan) return fail(plan.error());
  if (batch.n_tokens == 0 || plan->layers.empty()) return {};

  struct Item {
    uint32_t layer;
    uint32_t t0, t1;
  };
  std::vector<Item> items;
  for (uint32_t l = 0; l < plan->layers.size(); ++l)
    for (uint32_t t = 0; t < batch.n_tokens; t += kTokensPerItem)
      items.push_back({l, t, std::min(batch.n_tokens, t + kTokensPerItem)});

  unsigned n_threads = batch.n_threads != 0 ? batch.n_threads : std::max(1u, std::thread::hardware_concurrency());
  n_threads = static_cast<unsigned>(std::min<size_t>(n_threads, items.size()));
  std::atomic<size_t> next{0};
  std::mutex error_mutex;
  std::optional<Error> first_error;
  auto work = [&] {
    std::vector<std::byte> tile;
    for (size_t i = next.fetch_add(1); i < items.size(); i = next.fetch_add(1)) {
      const Item& item = items[i];
      auto done = scatter_range(*plan, plan->layers[item.layer], batch, item.t0, item.t1, tile);
      if (!done) {
        const std::lock_guard lock(error_mutex);
        if (!first_error) first_error = done.error();
        next.store(items.size());  // the others stop at their next item
        return;
      }
    }
  };
  {
    std::vector<std::jthread> helpers;
    for (unsigned i = 1; i < n_threads; ++i) helpers.emplace_back(work);
    work();
  }
  if (first_error) return fail(*first_error);
  return {};
}

Result<void> validate_scatter(const ScatterTarget& target, const ScatterBatch& batch) {
  auto plan = plan_scatter(target, batch);
  if (!plan) return fail(plan.error());
  return {};
}

Result<void> gather(const ScatterTarget& target, const GatherRequest& request, std::span<float> out) {
  const layout::KvCacheShape* cache = find_cache(target);
  if (cache == nullptr)
    return fail(EINVAL, "gather: cache index {} but the memory has {} KV cache(s)", target.cache_index,
                target.memory.kv_caches.size());
  const layout::SharedTensor* k = target.layout.find(target.cache_index, request.il, TensorKind::k);
  const layout::SharedTensor* v = target.layout.find(target.cache_index, request.il, TensorKind::v);
  if (k == nullptr) return fail(EINVAL, "gather: the share layout has no cache_k_l{}", request.il);
  const auto n_embd_k = static_cast<uint32_t>(k->tensor.ne[0]);
  uint32_t n_embd_v = 0;
  if (v != nullptr) {
    n_embd_v = static_cast<uint32_t>(v->tensor.ne[0]);
    if (cache->v_trans)
      for (const auto& layer : cache->layers)
        if (layer.il == request.il) n_embd_v = layer.n_embd_v_gqa;
  }
  auto plan = plan_layer(target, *cache, request.il, n_embd_k, n_embd_v, request.pos0, request.n_tokens, request.stream,
                         request.rotation_disabled);
  if (!plan) return fail(plan.error().with_context("gather"));
  const uint64_t row = static_cast<uint64_t>(n_embd_k) + n_embd_v;
  if (out.size() < row * request.n_tokens)
    return fail(EINVAL, "gather: layer {}: {} tokens of {} values need {} floats, the output holds {}", request.il,
                request.n_tokens, row, row * request.n_tokens, out.size());
  for (uint32_t t = 0; t < request.n_tokens; ++t) {
    float* dst = out.data() + t * row;
    const uint64_t cell = request.pos0 + t;
    layout::dequantize_row(plan->k->type, plan->k_stream + cell * plan->k->row_bytes, dst, n_embd_k);
    if (request.undo_rotation && plan->rotation_k > 0) layout::hadamard_rotate(dst, n_embd_k, plan->rotation_k);
    if (plan->v == nullptr) continue;
    float* v_dst = dst + n_embd_k;
    if (!cache->v_trans) {
      layout::dequantize_row(plan->v->type, plan->v_stream + cell * plan->v->row_bytes, v_dst, n_embd_v);
      if (request.undo_rotation && plan->rotation_v > 0) layout::hadamard_rotate(v_dst, n_embd_v, plan->rotation_v);
    } else {
      const uint64_t element = layout::ggml_row_size(plan->v->type, 1);
      for (uint64_t j = 0; j < n_embd_v; ++j)
        layout::dequantize_row(plan->v->type, plan->v_stream + (j * cache->kv_size + cell) * element, v_dst + j, 1);
    }
  }
  return {};
}

}  // namespace kvshare
