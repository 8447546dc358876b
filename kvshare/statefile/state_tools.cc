#include "kvshare/statefile/state_tools.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <nlohmann/json.hpp>

#include "kvshare/mapping.h"
#include "layout/gguf_reader.h"
#include "layout/memory_shape.h"
#include "layout/model_shape.h"
#include "layout/row_convert.h"

namespace kvshare::statefile {

using layout::GgmlType;
using layout::StateSection;
using layout::TensorKind;

namespace {

std::string kind_upper(TensorKind kind) {
  std::string name(layout::tensor_kind_name(kind));
  for (char& c : name) c = static_cast<char>(std::toupper(c));
  return name;
}

// The block role a section belongs to, for labels.
std::string role_of(const layout::StateLayout& layout, const StateSection& section) {
  for (const auto& block : layout.blocks)
    for (const auto& stream : block.streams)
      for (const auto& s : stream.sections)
        if (&s == &section) return block.role;
  return "?";
}

// The rotation group to undo for a section of a file, or an error when it cannot be known.
Result<int> rotation_group_for(const StateSection& section, const RotationInfo& rotation, const std::string& file) {
  if (section.kind != TensorKind::k && section.kind != TensorKind::v) return 0;
  if (!layout::is_quantized(section.type) || rotation.rotation_disabled) return 0;
  const uint32_t head = section.kind == TensorKind::k ? rotation.n_embd_head_k : rotation.n_embd_head_v;
  if (head == 0)
    return fail(EINVAL,
                "state file {}: layer {} {} is {} and llama.cpp rotates quantized caches: give the head size "
                "(--head-dim) or --no-rotation",
                file, section.il, kind_upper(section.kind), layout::ggml_type_name(section.type));
  return layout::kv_rotation_group(section.kind, section.type, head, false);
}

}  // namespace

Result<SectionStats> section_stats(const StateFile& file, const StateSection& section) {
  auto values = file.rows_f32(section);
  if (!values) return fail(values.error());
  SectionStats stats;
  double sum_sq = 0;
  uint64_t finite = 0;
  for (float v : *values) {
    if (!std::isfinite(v)) {
      ++stats.non_finite;
      continue;
    }
    stats.max_abs = std::max(stats.max_abs, double(std::fabs(v)));
    sum_sq += double(v) * double(v);
    ++finite;
  }
  stats.rms = finite ? std::sqrt(sum_sq / double(finite)) : 0.0;
  return stats;
}

Result<std::string> inspect_state_file(const std::filesystem::path& path, bool json) {
  auto file = read_state_file(path, nullptr);
  if (!file) return fail(file.error());
  const auto& layout = file->layout();

  nlohmann::json doc;
  doc["file"] = path.string();
  doc["bytes"] = file->bytes().size();
  doc["magic"] = "ggsq";
  doc["version"] = layout.version;
  doc["token_form"] = layout.token_form == layout::StateTokenForm::server_packed ? "server_packed" : "ids";
  doc["n_token_words"] = layout.n_token;
  doc["n_media"] = layout.n_media;
  doc["memory_kind"] = std::string(layout::memory_kind_name(layout.memory_kind));
  doc["mrope_cells"] = layout.has_mrope_cells;
  doc["n_token"] = layout.n_prompt_ids;
  doc["tokens"] = file->tokens();
  doc["trailing_bytes"] = layout.trailing_bytes;
  std::string text = fmt::format("{}: {} bytes, sequence state {}\n", path.string(), file->bytes().size(),
                                 layout::describe_state_layout(layout));
  if (layout.trailing_bytes)
    text += fmt::format("  {} trailing bytes after the content (llama.cpp ignores them)\n", layout.trailing_bytes);

  nlohmann::json blocks = nlohmann::json::array();
  for (const auto& block : layout.blocks) {
    nlohmann::json jb;
    jb["role"] = block.role;
    jb["kind"] = block.kind == layout::StateBlockKind::kv ? "kv" : "recurrent";
    jb["offset"] = block.offset;
    jb["bytes"] = block.end_offset - block.offset;
    jb["n_stream"] = block.n_stream;
    text += fmt::format("  block {} at offset {} ({} bytes, n_stream {})\n", block.role, block.offset,
                        block.end_offset - block.offset, block.n_stream);
    nlohmann::json streams = nlohmann::json::array();
    for (const auto& stream : block.streams) {
      nlohmann::json js;
      js["index"] = stream.index;
      js["cell_count"] = stream.cell_count;
      if (stream.cell_count > 0) {
        js["pos_first"] = stream.cells.front().pos;
        js["pos_last"] = stream.cells.back().pos;
        text +=
            fmt::format("    stream {}: {} cells, positions {}..{}{}\n", stream.index, stream.cell_count,
                        stream.cells.front().pos, stream.cells.back().pos,
                        stream.has_data ? fmt::format(", {} {}, n_layer {}",
                                                      block.kind == layout::StateBlockKind::kv ? "v_trans" : "s_trans",
                                                      stream.is_transposed ? 1 : 0, stream.n_layer)
                                        : std::string());
      } else if (stream.has_data) {
        text += fmt::format("    stream {}: no cells, n_layer {}\n", stream.index, stream.n_layer);
      }
      if (block.kind == layout::StateBlockKind::recurrent) {
        const auto n_r = std::count_if(stream.sections.begin(), stream.sections.end(),
                                       [](const StateSection& section) { return section.kind == TensorKind::r; });
        js["n_recurrent_layers"] = n_r;
        // Without the model the file does not say which layers are recurrent (hybrid models).
        if (static_cast<uint64_t>(n_r) < stream.n_layer)
          text += fmt::format(
              "    {} of the {} layers are recurrent; which ones is not in the file, so their "
              "sections are numbered 0..{}\n",
              n_r, stream.n_layer, n_r > 0 ? n_r - 1 : 0);
      }
      js["transposed"] = stream.is_transposed;
      js["n_layer"] = stream.n_layer;
      nlohmann::json sections = nlohmann::json::array();
      for (const auto& section : stream.sections) {
        nlohmann::json jsec;
        jsec["kind"] = std::string(layout::tensor_kind_name(section.kind));
        jsec["layer"] = section.il;
        jsec["type"] = std::string(layout::ggml_type_name(section.type));
        jsec["n_embd"] = section.n_embd;
        jsec["row_bytes"] = section.row_bytes;
        jsec["offset"] = section.header_offset;
        jsec["transposed"] = section.is_transposed;
        std::string stats_text;
        if (section.data_bytes() > 0) {  // no cells, or LFM2's empty S: no values
          auto stats = section_stats(*file, section);
          if (stats) {
            jsec["max_abs"] = stats->max_abs;
            jsec["rms"] = stats->rms;
            jsec["non_finite"] = stats->non_finite;
            stats_text = fmt::format("  max|x| {:.4g}  rms {:.4g}{}", stats->max_abs, stats->rms,
                                     stats->non_finite ? fmt::format("  {} NaN/Inf", stats->non_finite) : "");
          }
        }
        text += fmt::format("      layer {:3} {} {:5} n_embd {:6} row {:7} B at {:10}{}{}\n", section.il,
                            kind_upper(section.kind), layout::ggml_type_name(section.type), section.n_embd,
                            section.row_bytes, section.header_offset, section.is_transposed ? " (transposed)" : "",
                            stats_text);
        sections.push_back(std::move(jsec));
      }
      js["sections"] = std::move(sections);
      streams.push_back(std::move(js));
    }
    jb["streams"] = std::move(streams);
    blocks.push_back(std::move(jb));
  }
  doc["blocks"] = std::move(blocks);
  if (json) return doc.dump() + "\n";
  return text;
}

Result<std::string> verify_state_file(const std::filesystem::path& state_path, const std::filesystem::path& model_path,
                                      const layout::KvParams& params) {
  if (auto valid = layout::validate(params); !valid) return fail(valid.error());
  auto mapping = Mapping::map_file_readonly(model_path.string());
  if (!mapping) return fail(mapping.error());
  auto gguf = layout::parse_gguf(mapping->bytes(), model_path.string());
  if (!gguf) return fail(gguf.error());
  auto model = layout::derive_model_shape(gguf->metadata);
  if (!model) return fail(model.error().with_context(model_path.string()));
  auto memory = layout::derive_memory_shape(*model, params);
  if (!memory) return fail(memory.error().with_context(model_path.string()));
  auto file = read_state_file(state_path, &*memory);
  if (!file) return fail(file.error());
  // The prompt's ids, not the file's token words: llama-server's packed form carries 4+ words
  // of framing, and its restore checks the unpacked prompt against the slot's context.
  if (file->layout().n_prompt_ids > memory->n_ctx_seq)
    return fail(EINVAL, "state file {}: {} tokens exceed the slot's context of {} (-c {})", state_path.string(),
                file->layout().n_prompt_ids, memory->n_ctx_seq, params.n_ctx);
  return fmt::format("ok: {} restores into {} ({}) with {}", state_path.string(), model_path.filename().string(),
                     model->arch, layout::describe(params));
}

Result<DiffReport> diff_state_files(const std::filesystem::path& a_path, const std::filesystem::path& b_path,
                                    double tolerance, const RotationInfo& rotation) {
  auto a = read_state_file(a_path, nullptr);
  if (!a) return fail(a.error());
  auto b = read_state_file(b_path, nullptr);
  if (!b) return fail(b.error());
  const auto a_sections = a->sections();
  const auto b_sections = b->sections();
  const auto& la = a->layout();
  const auto& lb = b->layout();
  if (la.memory_kind != lb.memory_kind || a_sections.size() != b_sections.size())
    return fail(EINVAL, "state files {} and {} differ in structure: {} against {}", a_path.string(), b_path.string(),
                layout::describe_state_layout(la), layout::describe_state_layout(lb));
  for (size_t i = 0; i < la.blocks.size(); ++i) {
    const auto* sa = la.blocks[i].filled_stream();
    const auto* sb = lb.blocks[i].filled_stream();
    const bool same = (sa == nullptr) == (sb == nullptr) && (!sa || sa->cells == sb->cells);
    if (!same)
      return fail(EINVAL, "state files {} and {}: the {} block holds different cells", a_path.string(), b_path.string(),
                  la.blocks[i].role);
  }

  DiffReport report;
  if (a->tokens() != b->tokens()) report.text += "tokens differ\n";
  for (size_t i = 0; i < a_sections.size(); ++i) {
    const StateSection& sa = *a_sections[i];
    const StateSection& sb = *b_sections[i];
    const std::string label = fmt::format("{} layer {} {}", role_of(la, sa), sa.il, kind_upper(sa.kind));
    if (sa.kind != sb.kind || sa.n_embd != sb.n_embd || sa.n_rows != sb.n_rows)
      return fail(EINVAL, "state files {} and {}: {} has {} x {} values against {} x {}", a_path.string(),
                  b_path.string(), label, sa.n_rows, sa.n_embd, sb.n_rows, sb.n_embd);
    auto group_a = rotation_group_for(sa, rotation, a_path.string());
    if (!group_a) return fail(group_a.error());
    auto group_b = rotation_group_for(sb, rotation, b_path.string());
    if (!group_b) return fail(group_b.error());
    auto va = a->rows_f32(sa, *group_a);
    if (!va) return fail(va.error());
    auto vb = b->rows_f32(sb, *group_b);
    if (!vb) return fail(vb.error());
    double max_abs = 0, max_rel = 0;
    for (size_t j = 0; j < va->size(); ++j) {
      const double x = (*va)[j], y = (*vb)[j];
      const double d = std::isnan(x) != std::isnan(y) ? INFINITY : (std::isnan(x) ? 0.0 : std::fabs(x - y));
      max_abs = std::max(max_abs, d);
      const double scale = std::max({std::fabs(x), std::fabs(y), 1e-6});
      max_rel = std::max(max_rel, d / scale);
    }
    report.max_abs = std::max(report.max_abs, max_abs);
    report.text +=
        fmt::format("{:24} {:5} vs {:5}  max abs {:.6g}  max rel {:.6g}{}\n", label, layout::ggml_type_name(sa.type),
                    layout::ggml_type_name(sb.type), max_abs, max_rel, max_abs > tolerance ? "  EXCEEDS" : "");
  }
  report.within_tolerance = report.max_abs <= tolerance;
  report.text += fmt::format("max abs difference {:.6g}, tolerance {:.6g}: {}\n", report.max_abs, tolerance,
                             report.within_tolerance ? "within" : "exceeded");
  return report;
}

Result<CommitInfo> convert_state_file(const std::filesystem::path& in, const std::filesystem::path& out,
                                      const ConvertOptions& options) {
  auto source = read_state_file(in, nullptr);
  if (!source) return fail(source.error());
  layout::StateLayout target = source->layout();
  target.trailing_bytes = 0;
  if (target.n_media > 0)
    return fail(EINVAL,
                "convert {}: the prompt holds {} media chunks (images or audio); only text prompts are "
                "converted",
                in.string(), target.n_media);
  // The tokens go out as plain ids, which every llama-server generation restores.
  target.token_form = layout::StateTokenForm::ids;
  target.n_token = target.n_prompt_ids;
  if (auto rc = layout::set_state_version(target, options.to_version ? options.to_version : target.version); !rc)
    return fail(rc.error().with_context(fmt::format("convert {}", in.string())));
  layout::set_cell_tokens(target, source->tokens());
  for (auto& block : target.blocks) {
    if (block.kind != layout::StateBlockKind::kv) continue;
    for (auto& stream : block.streams)
      for (auto& section : stream.sections) {
        const auto& wanted = section.kind == TensorKind::k ? options.type_k : options.type_v;
        const GgmlType type = wanted ? *wanted : section.type;
        if (!layout::is_cache_type(type))
          return fail(EINVAL, "convert to {}: not a cache type llama-server accepts", layout::ggml_type_name(type));
        if (!layout::is_row_aligned(type, section.n_embd))
          return fail(EINVAL, "convert {}: layer {} {} has {} elements, not whole {} blocks", in.string(), section.il,
                      kind_upper(section.kind), section.n_embd, layout::ggml_type_name(type));
        if (section.is_transposed && layout::is_quantized(type))
          return fail(EINVAL,
                      "convert {}: V is transposed (written with -fa off) and a quantized V needs flash "
                      "attention",
                      in.string());
        section.type = type;
        section.row_bytes = section.is_transposed
                                ? static_cast<uint64_t>(layout::ggml_traits(type).type_size) * section.n_embd
                                : layout::ggml_row_size(type, section.n_embd);
      }
  }
  layout::assign_state_offsets(target);

  StateFileWriterOptions writer_options = options.writer;
  writer_options.n_embd_head_k = options.rotation.n_embd_head_k;
  writer_options.n_embd_head_v = options.rotation.n_embd_head_v;
  writer_options.rotation_disabled = options.rotation.rotation_disabled;
  auto writer = StateFileWriter::create_for_layout(out, target, source->tokens(), writer_options);
  if (!writer) return fail(writer.error());

  // Both layouts list sections in the same order; hand them over in file order, which is
  // ascending per region as the writer wants.
  const auto sections = source->sections();
  std::vector<const StateSection*> target_sections;
  for (const auto& block : writer->layout().blocks)
    for (const auto& stream : block.streams)
      for (const auto& section : stream.sections) target_sections.push_back(&section);
  for (size_t i = 0; i < sections.size(); ++i) {
    const StateSection* section = sections[i];
    if (section->data_bytes() == 0) continue;  // no cells, or LFM2's empty S: the header is all
    if (target_sections[i]->type == section->type) {
      // Unchanged type: the bytes go over as they are (no dequantize/requantize drift).
      const auto raw = source->rows(*section);
      const RowsView rows{section->type, raw.data(), section->n_rows, 0};
      if (auto rc = writer->write_section(section->kind, section->il, rows); !rc) return fail(rc.error());
      continue;
    }
    auto group = rotation_group_for(*section, options.rotation, in.string());
    if (!group) return fail(group.error());
    auto values = source->rows_f32(*section, *group);
    if (!values) return fail(values.error());
    const RowsView rows{GgmlType::F32, values->data(), section->n_rows, 0};
    if (auto rc = writer->write_section(section->kind, section->il, rows); !rc) return fail(rc.error());
  }
  return writer->commit();
}

}  // namespace kvshare::statefile
