#include "layout/layout_dump.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace kvshare::layout {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

std::string cache_label(const ShareHeader& header, uint32_t cache_index) {
  if (cache_index < header.memory.kv_caches.size()) return header.memory.kv_caches[cache_index].role;
  return "recurrent";
}

std::string shape_text(const std::array<int64_t, 4>& ne) {
  return fmt::format("[{}, {}, {}, {}]", ne[0], ne[1], ne[2], ne[3]);
}

// "layers [1, 3]": which layers a cache object holds tensors for; an iSWA base or SWA
// cache without layers gets no tensors and no chunk, which the line says.
template <class Layer>
std::string layers_text(const std::vector<Layer>& layers) {
  if (layers.empty()) return "no layers (no tensors, no chunk)";
  std::vector<uint32_t> ils;
  for (const Layer& layer : layers) ils.push_back(layer.il);
  return fmt::format("layers [{}]", fmt::join(ils, ", "));
}

// A recurrent width with what one cell of it takes (f32), and what a width of 0 means.
std::string state_width_text(std::string_view name, uint32_t width) {
  if (width == 0) return fmt::format("{} 0 (empty tensors: 0 bytes in the region)", name);
  return fmt::format("{} {} ({} bytes per cell)", name, width, uint64_t{width} * sizeof(float));
}

// The recurrent state's widths: once when every layer has the same (every arch so far),
// else per layer.
std::string recurrent_widths_text(const RecurrentShape& r) {
  if (r.layers.empty()) return "";
  const bool uniform = std::all_of(r.layers.begin(), r.layers.end(), [&](const RecurrentLayer& layer) {
    return layer.n_embd_r == r.layers.front().n_embd_r && layer.n_embd_s == r.layers.front().n_embd_s;
  });
  if (uniform)
    return fmt::format(", {}, {}", state_width_text("n_embd_r", r.layers.front().n_embd_r),
                       state_width_text("n_embd_s", r.layers.front().n_embd_s));
  std::string out;
  for (const RecurrentLayer& layer : r.layers)
    out += fmt::format("; layer {}: {}, {}", layer.il, state_width_text("n_embd_r", layer.n_embd_r),
                       state_width_text("n_embd_s", layer.n_embd_s));
  return out;
}

// Bytes of r and s one sequence cell takes over every recurrent layer.
uint64_t recurrent_bytes_per_cell(const RecurrentShape& r) {
  uint64_t total = 0;
  for (const CacheTensor& tensor : r.tensors) total += tensor.row_bytes;
  return total;
}

}  // namespace

Result<ShareHeader> header_for_model(const GgufFile& file, const KvParams& params) {
  auto shape = derive_model_shape(file.metadata);
  if (!shape) return fail(shape.error().with_context(fmt::format("model {}", file.name)));
  auto header = make_share_header(model_fingerprint(file.metadata, file.tensors), *shape, params);
  if (!header) return fail(header.error().with_context(fmt::format("model {} with {}", file.name, describe(params))));
  return header;
}

std::string render_layout_report(const ShareHeader& header) {
  std::string out;
  const ModelFingerprint& model = header.model;
  out += fmt::format("model: {}{} ({} layers, n_embd {}, n_vocab {}, tensors_hash {:#018x})\n", model.arch,
                     model.name.empty() ? "" : fmt::format(" \"{}\"", model.name), model.n_layer, model.n_embd,
                     model.n_vocab, model.tensors_hash);
  out += fmt::format("params: {}\n", describe(header.params));
  out += fmt::format("memory: {}, n_ctx {}, n_ctx_seq {}, n_pos_per_embd {}\n", memory_kind_name(header.memory.kind),
                     header.memory.n_ctx, header.memory.n_ctx_seq, header.memory.n_pos_per_embd);
  for (size_t i = 0; i < header.memory.kv_caches.size(); ++i) {
    const KvCacheShape& c = header.memory.kv_caches[i];
    out += fmt::format("cache {} ({}): kv_size {}, n_stream {}, K {}, V {}, v_trans {}, n_swa {}, {}\n", i, c.role,
                       c.kv_size, c.n_stream, ggml_type_name(c.type_k), ggml_type_name(c.type_v),
                       c.v_trans ? "yes" : "no", c.n_swa, layers_text(c.layers));
  }
  if (header.memory.recurrent) {
    const RecurrentShape& r = *header.memory.recurrent;
    out += fmt::format("cache {} (recurrent): rs_size {} (cells, one per sequence), f32 r/s state, {}{}\n",
                       header.memory.kv_caches.size(), r.rs_size, layers_text(r.layers), recurrent_widths_text(r));
  }

  out += fmt::format("\n{:<16} {:<6} {:<26} {:>5} {:>12} {:>12}  {}\n", "tensor", "type", "shape", "chunk", "offset",
                     "padded_bytes", "cache");
  for (const SharedTensor& s : header.layout.tensors)
    out += fmt::format("{:<16} {:<6} {:<26} {:>5} {:>12} {:>12}  {} {}\n", s.tensor.name, ggml_type_name(s.tensor.type),
                       shape_text(s.tensor.ne), s.chunk, s.offset, s.padded_bytes, s.cache_index,
                       cache_label(header, s.cache_index));

  out += fmt::format("\n{:<5} {:<10} {:>12} {:>10} {:<18}\n", "chunk", "cache", "size_bytes", "MiB", "layout_hash");
  for (size_t c = 0; c < header.layout.chunks.size(); ++c) {
    const ShareChunk& chunk = header.layout.chunks[c];
    out += fmt::format("{:<5} {:<10} {:>12} {:>10.2f} {:#018x}\n", c,
                       fmt::format("{} {}", chunk.cache_index, cache_label(header, chunk.cache_index)),
                       chunk.size_bytes, static_cast<double>(chunk.size_bytes) / kMiB, chunk.layout_hash);
  }

  const uint64_t total = header.layout.total_bytes();
  out += fmt::format("\ntotal: {} bytes ({:.2f} MiB) in {} chunks, {} tensors\n", total,
                     static_cast<double>(total) / kMiB, header.layout.chunks.size(), header.layout.tensors.size());
  out += fmt::format("kv bytes per token: {}\n", kv_bytes_per_token(header.memory));
  if (header.memory.recurrent)
    out += fmt::format("recurrent bytes per sequence: {}\n", recurrent_bytes_per_cell(*header.memory.recurrent));
  return out;
}

Result<std::string> render_layout_dump(const GgufFile& file, const KvParams& params, bool as_json) {
  auto header = header_for_model(file, params);
  if (!header) return fail(header.error());
  return as_json ? to_json(*header) : render_layout_report(*header);
}

Result<std::string> render_header_check(std::string_view json, std::string_view source) {
  auto header = parse_share_header(json, source);
  if (!header) return fail(header.error());
  return fmt::format("{}: valid layout header, format version {}\n", source, header->format_version) +
         render_layout_report(*header);
}

}  // namespace kvshare::layout
