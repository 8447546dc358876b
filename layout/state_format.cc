#include "layout/state_format.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <optional>

namespace kvshare::layout {
namespace {

constexpr uint64_t kKvCellBytes = 12;        // pos, n_seq_id, one seq id
constexpr uint64_t kCellExtBytesV2 = 8;      // llama_kv_cell_ext {x, y}
constexpr uint64_t kCellExtBytesV3 = 12;     // llama_kv_cell_ext {x, y, tok}
constexpr uint64_t kRecurrentCellBytes = 8;  // pos, n_seq_id = 0

// llama_hparams::is_masked_swa for the window types a KvCacheShape can carry. n_swa 0 masks
// nothing (a non-SWA cache).
bool is_masked_swa(uint32_t n_swa, SwaType swa_type, int64_t p0, int64_t p1) {
  if (n_swa == 0) return false;
  switch (swa_type) {
    case SwaType::none:
      return false;
    case SwaType::standard:
      return p1 - p0 >= static_cast<int64_t>(n_swa);
    case SwaType::chunked:
      return p0 < (p1 / n_swa) * static_cast<int64_t>(n_swa);
  }
  return false;
}

GgmlType tensor_type_or(const std::vector<CacheTensor>& tensors, TensorKind kind, uint32_t il, GgmlType fallback) {
  for (const auto& tensor : tensors)
    if (tensor.kind == kind && tensor.layer == il) return tensor.type;
  return fallback;
}

Result<StateSection> plan_row_section(TensorKind kind, uint32_t il, GgmlType type, uint32_t n_embd, bool transposed,
                                      uint32_t n_rows) {
  if (!is_row_aligned(type, n_embd))
    return fail(EINVAL, "layer {} {}: {} elements are not a whole number of {} blocks ({} elements each)", il,
                tensor_kind_name(kind), n_embd, ggml_type_name(type), ggml_traits(type).block_size);
  StateSection section;
  section.kind = kind;
  section.il = il;
  section.type = type;
  section.n_embd = n_embd;
  section.is_transposed = transposed;
  // Mirrors state_write_data: a transposed V row is n_embd elements of type_size bytes.
  section.row_bytes =
      transposed ? static_cast<uint64_t>(ggml_traits(type).type_size) * n_embd : ggml_row_size(type, n_embd);
  section.n_rows = n_rows;
  return section;
}

Result<StateBlock> plan_kv_block(const KvCacheShape& cache, uint32_t n_cells, bool mrope, uint32_t version) {
  StateBlock block;
  block.kind = StateBlockKind::kv;
  block.role = cache.role.empty() ? "kv" : cache.role;
  if (cache.n_stream == 0) return fail(EINVAL, "{} KV cache: n_stream is 0", block.role);
  block.n_stream = cache.n_stream;

  // The window only ever drops the oldest positions, so the kept cells are a tail.
  uint32_t first_kept = 0;
  while (first_kept < n_cells && is_masked_swa(cache.n_swa, cache.swa_type, first_kept, int64_t{n_cells} - 1))
    ++first_kept;
  const uint32_t cell_count = n_cells - first_kept;
  if (cell_count > cache.kv_size)
    return fail(EINVAL, "{} KV cache: {} cells do not fit its kv_size of {} cells", block.role, cell_count,
                cache.kv_size);
  if (cache.v_trans && is_quantized(cache.type_v))
    return fail(EINVAL, "{} KV cache: a quantized V cache ({}) needs flash attention (v_trans 0)", block.role,
                ggml_type_name(cache.type_v));

  // Sequence 0 lives in stream 0 (seq_to_stream[0] is 0, unified or not).
  for (uint32_t s = 0; s < cache.n_stream; ++s) {
    StateStream stream;
    stream.index = s;
    if (s == 0 && cell_count > 0) {
      stream.cell_count = cell_count;
      stream.cell_record_bytes = kv_cell_record_bytes(version, mrope);
      stream.cells.reserve(cell_count);
      for (uint32_t pos = first_kept; pos < n_cells; ++pos) {
        const auto p = static_cast<int32_t>(pos);
        stream.cells.push_back(StateCell{.pos = p, .n_seq_id = 1, .ext_x = mrope ? p : 0, .ext_y = mrope ? p : 0});
      }
      stream.has_data = true;
      stream.is_transposed = cache.v_trans;
      stream.n_layer = static_cast<uint32_t>(cache.layers.size());
      for (const auto& layer : cache.layers) {
        auto section = plan_row_section(TensorKind::k, layer.il, cache.type_k, layer.n_embd_k_gqa, false, cell_count);
        if (!section) return fail(section.error().with_context(block.role + " KV cache"));
        stream.sections.push_back(*section);
      }
      for (const auto& layer : cache.layers) {
        if (!layer.has_v) continue;  // MLA: no V tensor, no V section (not even a header)
        auto section =
            plan_row_section(TensorKind::v, layer.il, cache.type_v, layer.n_embd_v_gqa, cache.v_trans, cell_count);
        if (!section) return fail(section.error().with_context(block.role + " KV cache"));
        stream.sections.push_back(*section);
      }
    }
    block.streams.push_back(std::move(stream));
  }
  return block;
}

Result<StateBlock> plan_recurrent_block(const RecurrentShape& recurrent, uint32_t n_cells) {
  StateBlock block;
  block.kind = StateBlockKind::recurrent;
  block.role = "recurrent";
  block.n_stream = 1;
  StateStream stream;
  stream.cell_record_bytes = kRecurrentCellBytes;
  // One cell per sequence, at the position of its last token; n_seq_id 0 in a sequence file.
  if (n_cells > 0) {
    stream.cell_count = 1;
    stream.cells.push_back(StateCell{.pos = static_cast<int32_t>(n_cells - 1), .n_seq_id = 0});
  }
  stream.has_data = true;
  stream.is_transposed = false;
  stream.n_layer = recurrent.n_layer;
  for (TensorKind kind : {TensorKind::r, TensorKind::s}) {
    for (const auto& layer : recurrent.layers) {
      const GgmlType type = tensor_type_or(recurrent.tensors, kind, layer.il, GgmlType::F32);
      const uint32_t n_embd = kind == TensorKind::r ? layer.n_embd_r : layer.n_embd_s;
      auto section = plan_row_section(kind, layer.il, type, n_embd, false, stream.cell_count);
      if (!section) return fail(section.error().with_context("recurrent block"));
      stream.sections.push_back(*section);
    }
  }
  block.streams.push_back(std::move(stream));
  return block;
}

// ---- encoding helpers -------------------------------------------------------------------

template <class T>
void put(std::vector<std::byte>& out, T value) {
  const auto* bytes = reinterpret_cast<const std::byte*>(&value);
  out.insert(out.end(), bytes, bytes + sizeof value);
}

void put_section_header(std::vector<std::byte>& out, const StateSection& section) {
  put<int32_t>(out, static_cast<int32_t>(section.type));
  if (section.is_transposed) {
    put<uint32_t>(out, static_cast<uint32_t>(ggml_traits(section.type).type_size));
    put<uint32_t>(out, section.n_embd);
  } else {
    put<uint64_t>(out, section.row_bytes);
  }
}

// ---- decoding ---------------------------------------------------------------------------

// A decoding failure plus how far the reading got, so inspect mode can report the error of
// the reading that explained most of the file.
struct ParseError {
  Error error;
  uint64_t offset = 0;
  bool is_kv_cell_value = false;      // a KV cell's pos or n_seq_id is out of range
  bool is_recurrent_section = false;  // inspect mode: an R/S section of a recurrent block is bad
};

template <class T>
using ParseResult = tl::expected<T, ParseError>;

tl::unexpected<ParseError> kv_cell_error(tl::unexpected<ParseError> error) {
  error.value().is_kv_cell_value = true;
  return error;
}

class Cursor {
 public:
  Cursor(std::span<const std::byte> file, std::string_view name) : file_(file), name_(name) {}

  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return file_.size() - pos_; }
  std::string_view name() const { return name_; }

  template <class... Args>
  tl::unexpected<ParseError> error_at(uint64_t offset, fmt::format_string<Args...> format, Args&&... args) const {
    return tl::unexpected<ParseError>(
        ParseError{Error(EINVAL, fmt::format("state file {}: {} (offset {})", name_,
                                             fmt::format(format, std::forward<Args>(args)...), offset)),
                   offset});
  }

  template <class T>
  ParseResult<T> take(std::string_view field) {
    if (remaining() < sizeof(T))
      return error_at(pos_, "file ends at byte {} inside {} ({} bytes needed)", file_.size(), field, sizeof(T));
    T value;
    std::memcpy(&value, file_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }

  // Skips `count` items of `item_bytes` each, checking the file holds them (overflow-safe).
  ParseResult<void> skip(uint64_t count, uint64_t item_bytes, std::string_view field) {
    if (item_bytes != 0 && count > remaining() / item_bytes)
      return error_at(pos_, "file ends at byte {} inside {} ({} x {} bytes needed, {} left)", file_.size(), field,
                      count, item_bytes, remaining());
    pos_ += count * item_bytes;
    return {};
  }

 private:
  std::span<const std::byte> file_;
  std::string_view name_;
  uint64_t pos_ = 0;
};

// Expectations for one section when a memory shape is given.
struct SectionExpect {
  TensorKind kind;
  uint32_t il;
  GgmlType type;
  uint32_t n_embd;
};

std::string section_label(std::string_view role, TensorKind kind, uint32_t il) {
  std::string kind_name(tensor_kind_name(kind));
  std::transform(kind_name.begin(), kind_name.end(), kind_name.begin(), [](char c) { return char(std::toupper(c)); });
  return fmt::format("{} layer {} {}", role, il, kind_name);
}

ParseResult<StateSection> parse_section(Cursor& in, std::string_view role, TensorKind kind, uint32_t ordinal,
                                        bool transposed, uint32_t n_rows, const SectionExpect* expect) {
  StateSection section;
  section.kind = kind;
  section.il = expect ? expect->il : ordinal;
  section.is_transposed = transposed;
  section.n_rows = n_rows;
  section.header_offset = in.pos();
  const std::string label = section_label(role, kind, section.il);

  KVSHARE_TRY_ASSIGN(auto type_id, in.take<int32_t>(label + " type"));
  const auto traits = ggml_type_traits(type_id);
  if (!traits) return in.error_at(section.header_offset, "{} type is {}, not a ggml type", label, type_id);
  section.type = static_cast<GgmlType>(type_id);
  if (expect && section.type != expect->type)
    return in.error_at(section.header_offset, "{} type is {} ({}), layout says {} ({})", label, type_id, traits->name,
                       static_cast<int32_t>(expect->type), ggml_type_name(expect->type));

  if (transposed) {
    const uint64_t el_offset = in.pos();
    KVSHARE_TRY_ASSIGN(auto el_size, in.take<uint32_t>(label + " element size"));
    if (el_size != static_cast<uint64_t>(traits->type_size))
      return in.error_at(el_offset, "{} element size is {} bytes, {} has {}", label, el_size, traits->name,
                         traits->type_size);
    const uint64_t n_embd_offset = in.pos();
    KVSHARE_TRY_ASSIGN(auto n_embd, in.take<uint32_t>(label + " n_embd_v_gqa"));
    if (expect && n_embd != expect->n_embd)
      return in.error_at(n_embd_offset, "{} n_embd_v_gqa is {}, layout says {}", label, n_embd, expect->n_embd);
    if (n_embd == 0) return in.error_at(n_embd_offset, "{} n_embd_v_gqa is 0", label);
    section.n_embd = n_embd;
    section.row_bytes = uint64_t{el_size} * n_embd;
  } else {
    const uint64_t row_offset = in.pos();
    KVSHARE_TRY_ASSIGN(auto row_bytes, in.take<uint64_t>(label + " row size"));
    if (expect) {
      const uint64_t want = ggml_row_size(expect->type, expect->n_embd);
      if (row_bytes != want)
        return in.error_at(row_offset, "{} row size is {} bytes, layout says {}", label, row_bytes, want);
      section.n_embd = expect->n_embd;
    } else {
      const auto type_size = static_cast<uint64_t>(traits->type_size);
      const auto block_size = static_cast<uint64_t>(traits->block_size);
      if (row_bytes == 0 || row_bytes % type_size != 0 ||
          row_bytes / type_size > std::numeric_limits<uint32_t>::max() / block_size)
        return in.error_at(row_offset, "{} row size {} bytes is not a whole number of {} blocks ({} bytes)", label,
                           row_bytes, traits->name, type_size);
      section.n_embd = static_cast<uint32_t>(row_bytes / type_size * block_size);
    }
    section.row_bytes = row_bytes;
  }
  section.data_offset = in.pos();
  KVSHARE_TRY(in.skip(n_rows, section.row_bytes, label + " rows"));
  return section;
}

ParseResult<std::vector<StateSection>> parse_sections(Cursor& in, std::string_view role, TensorKind kind,
                                                      uint32_t count, bool transposed, uint32_t n_rows,
                                                      const std::vector<SectionExpect>* expect) {
  std::vector<StateSection> sections;
  // Each section takes at least its 12-byte header: bound the reservation by the file.
  sections.reserve(std::min<uint64_t>(count, in.remaining() / kStateSectionHeaderBytes));
  for (uint32_t i = 0; i < count; ++i) {
    KVSHARE_TRY_ASSIGN(auto section,
                       parse_section(in, role, kind, i, transposed, n_rows, expect ? &(*expect)[i] : nullptr));
    sections.push_back(section);
  }
  return sections;
}

ParseResult<StateBlock> parse_kv_block(Cursor& in, std::string role, bool mrope, uint32_t version,
                                       const KvCacheShape* expect) {
  StateBlock block;
  block.kind = StateBlockKind::kv;
  block.role = std::move(role);
  block.offset = in.pos();
  KVSHARE_TRY_ASSIGN(auto n_stream, in.take<uint32_t>(block.role + " KV block n_stream"));
  if (expect && n_stream != expect->n_stream)
    return in.error_at(block.offset, "{} KV block n_stream is {}, layout says {} (-kvu / -np differ)", block.role,
                       n_stream, expect->n_stream);
  if (n_stream == 0) return in.error_at(block.offset, "{} KV block n_stream is 0", block.role);
  if (n_stream > in.remaining() / 4)
    return in.error_at(block.offset, "{} KV block n_stream {} needs more bytes than the file has", block.role,
                       n_stream);
  block.n_stream = n_stream;
  block.streams.reserve(n_stream);

  std::vector<SectionExpect> k_expect, v_expect;
  if (expect) {
    for (const auto& layer : expect->layers) {
      k_expect.push_back({TensorKind::k, layer.il, expect->type_k, layer.n_embd_k_gqa});
      if (layer.has_v) v_expect.push_back({TensorKind::v, layer.il, expect->type_v, layer.n_embd_v_gqa});
    }
  }

  for (uint32_t s = 0; s < n_stream; ++s) {
    StateStream stream;
    stream.index = s;
    stream.offset = in.pos();
    const std::string where = n_stream == 1 ? block.role : fmt::format("{} stream {}", block.role, s);
    KVSHARE_TRY_ASSIGN(auto cell_count, in.take<uint32_t>(where + " cell_count"));
    stream.cell_count = cell_count;
    if (cell_count == 0) {
      block.streams.push_back(std::move(stream));
      continue;
    }
    if (expect && cell_count > expect->kv_size)
      return in.error_at(stream.offset, "{} cell_count {} exceeds the cache's kv_size of {} cells", where, cell_count,
                         expect->kv_size);

    stream.cells_offset = in.pos();
    stream.cell_record_bytes = kv_cell_record_bytes(version, mrope);
    if (cell_count > in.remaining() / stream.cell_record_bytes)
      return in.error_at(stream.offset, "file ends at byte {} inside the {} cells ({} x {} bytes needed)",
                         stream.offset + 4 + in.remaining(), where, cell_count, stream.cell_record_bytes);
    stream.cells.reserve(cell_count);
    for (uint32_t i = 0; i < cell_count; ++i) {
      StateCell cell;
      const uint64_t cell_offset = in.pos();
      KVSHARE_TRY_ASSIGN(auto pos, in.take<int32_t>("cell pos"));
      KVSHARE_TRY_ASSIGN(auto n_seq_id, in.take<uint32_t>("cell n_seq_id"));
      // llama_kv_cache::state_read_meta: a sequence file's cells belong to exactly one sequence.
      if (n_seq_id != 1)
        return kv_cell_error(in.error_at(cell_offset + 4, "{} cell {}: n_seq_id is {}, a sequence file has exactly 1",
                                         where, i, n_seq_id));
      if (pos < 0) return kv_cell_error(in.error_at(cell_offset, "{} cell {}: pos is {}, negative", where, i, pos));
      cell.pos = pos;
      cell.n_seq_id = n_seq_id;
      if (mrope) {
        KVSHARE_TRY_ASSIGN(auto x, in.take<int32_t>("cell ext x"));
        KVSHARE_TRY_ASSIGN(auto y, in.take<int32_t>("cell ext y"));
        cell.ext_x = x;
        cell.ext_y = y;
        if (version >= kStateSeqVersion3) {
          KVSHARE_TRY_ASSIGN(auto tok, in.take<int32_t>("cell ext tok"));
          cell.ext_tok = tok;
        }
      }
      KVSHARE_TRY_ASSIGN(auto seq_id, in.take<int32_t>("cell seq_id"));
      cell.seq_id = seq_id;
      stream.cells.push_back(cell);
    }

    stream.has_data = true;
    stream.data_header_offset = in.pos();
    KVSHARE_TRY_ASSIGN(auto v_trans, in.take<uint32_t>(where + " v_trans"));
    if (v_trans > 1) return in.error_at(stream.data_header_offset, "{} v_trans is {}, not 0 or 1", where, v_trans);
    if (expect && (v_trans != 0) != expect->v_trans)
      return in.error_at(stream.data_header_offset,
                         "{} v_trans is {}, layout says {} (incompatible V transposition: -fa on writes 0, -fa off 1)",
                         where, v_trans, expect->v_trans ? 1 : 0);
    stream.is_transposed = v_trans != 0;
    const uint64_t n_layer_offset = in.pos();
    KVSHARE_TRY_ASSIGN(auto n_layer, in.take<uint32_t>(where + " n_layer"));
    if (expect && n_layer != expect->layers.size())
      return in.error_at(n_layer_offset, "{} n_layer is {}, layout says {}", where, n_layer, expect->layers.size());
    if (n_layer > in.remaining() / kStateSectionHeaderBytes)
      return in.error_at(n_layer_offset, "{} n_layer {} needs more bytes than the file has", where, n_layer);
    stream.n_layer = n_layer;

    KVSHARE_TRY_ASSIGN(auto k_sections, parse_sections(in, block.role, TensorKind::k, n_layer, false, cell_count,
                                                       expect ? &k_expect : nullptr));
    stream.sections = std::move(k_sections);
    if (expect) {
      KVSHARE_TRY_ASSIGN(auto v_sections,
                         parse_sections(in, block.role, TensorKind::v, static_cast<uint32_t>(v_expect.size()),
                                        stream.is_transposed, cell_count, &v_expect));
      stream.sections.insert(stream.sections.end(), v_sections.begin(), v_sections.end());
    } else {
      // Without a shape, V is one section per layer, or none at all (MLA caches).
      Cursor attempt = in;
      auto v_sections =
          parse_sections(attempt, block.role, TensorKind::v, n_layer, stream.is_transposed, cell_count, nullptr);
      if (v_sections) {
        in = attempt;
        stream.sections.insert(stream.sections.end(), v_sections->begin(), v_sections->end());
      } else if (n_layer == 0) {
        return tl::unexpected(v_sections.error());
      }
    }
    block.streams.push_back(std::move(stream));
  }
  block.end_offset = in.pos();
  return block;
}

tl::unexpected<ParseError> recurrent_section_error(tl::unexpected<ParseError> error) {
  error.value().is_recurrent_section = true;
  return error;
}

// One R or S section read without the model: i32 type, u64 row size, n_rows rows. Recurrent
// state is always f32 (llama_memory_recurrent creates r_l/s_l as GGML_TYPE_F32), so any other
// type, or a row that is not whole f32 elements, is not a section. A row size of 0 is one:
// LFM2 has no S state and llama.cpp still writes the S header (n_embd_s() is 0).
ParseResult<StateSection> parse_recurrent_section(Cursor& in, uint32_t ordinal, uint32_t n_rows) {
  StateSection section;
  section.il = ordinal;
  section.n_rows = n_rows;
  section.header_offset = in.pos();
  const std::string label = fmt::format("recurrent section {}", ordinal);
  auto type_id = in.take<int32_t>(label + " type");
  if (!type_id) return recurrent_section_error(tl::unexpected(type_id.error()));
  if (*type_id != static_cast<int32_t>(GgmlType::F32)) {
    const auto traits = ggml_type_traits(*type_id);
    return recurrent_section_error(in.error_at(section.header_offset,
                                               "{} type is {} ({}), llama.cpp writes recurrent state as f32 (0)", label,
                                               *type_id, traits ? traits->name : "not a ggml type"));
  }
  section.type = GgmlType::F32;
  const uint64_t row_offset = in.pos();
  auto row_bytes = in.take<uint64_t>(label + " row size");
  if (!row_bytes) return recurrent_section_error(tl::unexpected(row_bytes.error()));
  if (*row_bytes % 4 != 0 || *row_bytes / 4 > std::numeric_limits<uint32_t>::max())
    return recurrent_section_error(
        in.error_at(row_offset, "{} row size {} bytes is not a whole number of f32 elements", label, *row_bytes));
  section.row_bytes = *row_bytes;
  section.n_embd = static_cast<uint32_t>(*row_bytes / 4);
  section.data_offset = in.pos();
  if (auto rows = in.skip(n_rows, section.row_bytes, label + " rows"); !rows)
    return recurrent_section_error(tl::unexpected(rows.error()));
  return section;
}

// The R and S sections of a recurrent block read without the model. llama.cpp writes one R
// section per layer that has recurrent tensors, then one S section per such layer
// (state_write_data skips the others), so their number is not in the file: n_layer counts
// every trunk layer (hparams.n_layer()). Sections are read up to the end of the file (the
// recurrent block is always the last block) or until 2 x n_layer of them, after which any
// bytes are trailing; then the first half is R and the second S. Refused with the offset: a
// leftover that is not a section (damage and trailing bytes cannot be told apart), an odd
// count, or R (or S) sections of unequal row sizes (n_embd_r and n_embd_s are per model).
// Section il are ordinals: which layers are recurrent is not in the file.
ParseResult<std::vector<StateSection>> parse_recurrent_sections(Cursor& in, uint32_t n_layer, uint32_t n_rows) {
  const uint64_t first_offset = in.pos();
  const uint64_t max_sections = uint64_t{n_layer} * 2;
  std::vector<StateSection> run;
  // Each section takes at least its 12-byte header: bound the reservation by the file.
  run.reserve(std::min<uint64_t>(max_sections, in.remaining() / kStateSectionHeaderBytes));
  while (in.remaining() > 0 && run.size() < max_sections) {
    KVSHARE_TRY_ASSIGN(auto section, parse_recurrent_section(in, static_cast<uint32_t>(run.size()), n_rows));
    run.push_back(section);
  }
  if (run.size() % 2 != 0)
    return recurrent_section_error(in.error_at(
        first_offset,
        "recurrent block holds {} sections from offset {} to the end of the file; R and S sections come in pairs "
        "(one of each per recurrent layer), so a whole block has an even number",
        run.size(), first_offset));
  const size_t n_recurrent = run.size() / 2;
  for (size_t i = 0; i < run.size(); ++i) {
    StateSection& section = run[i];
    const bool is_r = i < n_recurrent;
    section.kind = is_r ? TensorKind::r : TensorKind::s;
    section.il = static_cast<uint32_t>(is_r ? i : i - n_recurrent);
    const StateSection& first = run[is_r ? 0 : n_recurrent];
    if (section.row_bytes != first.row_bytes)
      return recurrent_section_error(in.error_at(
          section.header_offset + 4,
          "recurrent section {} ({} of recurrent layer {}) row size is {} bytes, section {} has {}: llama.cpp writes "
          "every {} row with one size ({})",
          i, is_r ? "R" : "S", section.il, section.row_bytes, is_r ? 0 : n_recurrent, first.row_bytes, is_r ? "R" : "S",
          is_r ? "n_embd_r" : "n_embd_s"));
  }
  return run;
}

ParseResult<StateBlock> parse_recurrent_block(Cursor& in, const RecurrentShape* expect) {
  StateBlock block;
  block.kind = StateBlockKind::recurrent;
  block.role = "recurrent";
  block.offset = in.pos();
  block.n_stream = 1;
  StateStream stream;
  stream.offset = in.pos();
  stream.cell_record_bytes = static_cast<uint32_t>(kRecurrentCellBytes);
  KVSHARE_TRY_ASSIGN(auto cell_count, in.take<uint32_t>("recurrent cell_count"));
  if (expect && cell_count > expect->rs_size)
    return in.error_at(stream.offset, "recurrent cell_count {} exceeds the memory's {} cells", cell_count,
                       expect->rs_size);
  if (cell_count > in.remaining() / kRecurrentCellBytes)
    return in.error_at(stream.offset, "file ends at byte {} inside the recurrent cells ({} x 8 bytes needed)",
                       stream.offset + 4 + in.remaining(), cell_count);
  stream.cell_count = cell_count;
  stream.cells_offset = in.pos();
  stream.cells.reserve(cell_count);
  for (uint32_t i = 0; i < cell_count; ++i) {
    const uint64_t cell_offset = in.pos();
    KVSHARE_TRY_ASSIGN(auto pos, in.take<int32_t>("recurrent cell pos"));
    KVSHARE_TRY_ASSIGN(auto n_seq_id, in.take<uint32_t>("recurrent cell n_seq_id"));
    // llama_memory_recurrent::state_read_meta: seq ids appear only in whole-context saves.
    if (n_seq_id != 0)
      return in.error_at(cell_offset + 4, "recurrent cell {}: n_seq_id is {}, a sequence file has 0", i, n_seq_id);
    if (pos < 0) return in.error_at(cell_offset, "recurrent cell {}: pos is {}, negative", i, pos);
    stream.cells.push_back(StateCell{.pos = pos, .n_seq_id = 0});
  }
  stream.has_data = true;
  stream.data_header_offset = in.pos();
  KVSHARE_TRY_ASSIGN(auto s_trans, in.take<uint32_t>("recurrent s_trans"));
  if (s_trans != 0)
    return in.error_at(stream.data_header_offset, "recurrent s_trans is {}, llama.cpp only writes 0", s_trans);
  const uint64_t n_layer_offset = in.pos();
  KVSHARE_TRY_ASSIGN(auto n_layer, in.take<uint32_t>("recurrent n_layer"));
  if (expect && n_layer != expect->n_layer)
    return in.error_at(n_layer_offset, "recurrent n_layer is {}, layout says {}", n_layer, expect->n_layer);
  stream.n_layer = n_layer;

  if (expect) {
    std::vector<SectionExpect> r_expect, s_expect;
    for (const auto& layer : expect->layers) {
      r_expect.push_back({TensorKind::r, layer.il,
                          tensor_type_or(expect->tensors, TensorKind::r, layer.il, GgmlType::F32), layer.n_embd_r});
      s_expect.push_back({TensorKind::s, layer.il,
                          tensor_type_or(expect->tensors, TensorKind::s, layer.il, GgmlType::F32), layer.n_embd_s});
    }
    const auto count = static_cast<uint32_t>(r_expect.size());
    KVSHARE_TRY_ASSIGN(auto r_sections,
                       parse_sections(in, "recurrent", TensorKind::r, count, false, cell_count, &r_expect));
    KVSHARE_TRY_ASSIGN(auto s_sections,
                       parse_sections(in, "recurrent", TensorKind::s, count, false, cell_count, &s_expect));
    stream.sections = std::move(r_sections);
    stream.sections.insert(stream.sections.end(), s_sections.begin(), s_sections.end());
  } else {
    KVSHARE_TRY_ASSIGN(auto sections, parse_recurrent_sections(in, n_layer, cell_count));
    stream.sections = std::move(sections);
  }
  block.streams.push_back(std::move(stream));
  block.end_offset = in.pos();
  return block;
}

struct BlockPlan {
  std::vector<std::string> kv_roles;
  bool has_recurrent = false;
};

BlockPlan blocks_of_kind(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::none:
      return {{}, false};
    case MemoryKind::kv:
      return {{"kv"}, false};
    case MemoryKind::kv_iswa:
      return {{"base", "swa"}, false};
    case MemoryKind::recurrent:
      return {{}, true};
    case MemoryKind::hybrid:
      return {{"kv"}, true};
    case MemoryKind::hybrid_iswa:
      return {{"base", "swa"}, true};
  }
  return {};
}

ParseResult<StateLayout> parse_memory(std::span<const std::byte> file, std::string_view name, uint64_t start,
                                      const StateLayout& header, MemoryKind kind, bool mrope,
                                      const MemoryShape* expect) {
  Cursor in(file, name);
  KVSHARE_TRY(in.skip(1, start, "header"));
  StateLayout layout = header;
  layout.memory_kind = kind;
  layout.has_mrope_cells = mrope;
  if (expect) {
    for (const auto& cache : expect->kv_caches) {
      KVSHARE_TRY_ASSIGN(auto block,
                         parse_kv_block(in, cache.role.empty() ? "kv" : cache.role, mrope, layout.version, &cache));
      layout.blocks.push_back(std::move(block));
    }
    if (expect->recurrent) {
      KVSHARE_TRY_ASSIGN(auto block, parse_recurrent_block(in, &*expect->recurrent));
      layout.blocks.push_back(std::move(block));
    }
  } else {
    const BlockPlan plan = blocks_of_kind(kind);
    // The file does not carry layer indices: number the KV blocks' layers on from one block
    // to the next (base 0..nb-1, then SWA nb..), so each (kind, il) names one section.
    uint32_t first_il = 0;
    for (const auto& role : plan.kv_roles) {
      KVSHARE_TRY_ASSIGN(auto block, parse_kv_block(in, role, mrope, layout.version, nullptr));
      uint32_t n_layer = 0;
      for (auto& stream : block.streams) {
        for (auto& section : stream.sections) section.il += first_il;
        n_layer = std::max(n_layer, stream.n_layer);
      }
      first_il += n_layer;
      layout.blocks.push_back(std::move(block));
    }
    if (plan.has_recurrent) {
      KVSHARE_TRY_ASSIGN(auto block, parse_recurrent_block(in, nullptr));
      layout.blocks.push_back(std::move(block));
    }
  }
  layout.content_bytes = in.pos();
  layout.trailing_bytes = in.remaining();
  return layout;
}

// Reads the token words of a version 3 file written by llama-server's slot save
// (server_tokens::serialize) when they start with -1, the marker no id can be; else the words
// are plain ids. Errors name the word's byte offset, as server_tokens::deserialize refuses
// the same inputs.
Result<void> decode_token_form(std::span<const std::byte> file, StateLayout& layout, std::string_view name) {
  layout.token_form = StateTokenForm::ids;
  layout.n_prompt_ids = layout.n_token;
  layout.prompt_ids_offset = layout.tokens_offset;
  layout.n_media = 0;
  const uint64_t begin = layout.tokens_offset;
  const uint64_t end = begin + uint64_t{4} * layout.n_token;
  auto word_at = [&](uint64_t off) {
    uint32_t value = 0;
    std::memcpy(&value, file.data() + off, 4);
    return value;
  };
  if (layout.version < kStateSeqVersion3 || layout.n_token == 0 || static_cast<int32_t>(word_at(begin)) != -1)
    return {};
  auto bad = [&](uint64_t off, std::string what) {
    return fail(EINVAL, "state file {}: packed slot tokens (llama-server's server_tokens): {} (offset {})", name, what,
                off);
  };
  uint64_t off = begin + 4;
  auto take_u32 = [&](std::string_view field) -> Result<uint32_t> {
    if (end - off < 4) return bad(off, fmt::format("the token words end inside {}", field));
    const uint32_t value = word_at(off);
    off += 4;
    return value;
  };
  auto packing = take_u32("the packing version");
  if (!packing) return fail(packing.error());
  if (*packing != kServerTokensStateVersion)
    return bad(off - 4,
               fmt::format("packing version is {}, llama-server writes {}", *packing, kServerTokensStateVersion));
  auto n_ids = take_u32("the id count");
  if (!n_ids) return fail(n_ids.error());
  if (*n_ids > (end - off) / 4)
    return bad(off - 4, fmt::format("{} ids do not fit the {} token words", *n_ids, layout.n_token));
  layout.prompt_ids_offset = off;
  layout.n_prompt_ids = *n_ids;
  off += uint64_t{4} * *n_ids;
  auto n_keys = take_u32("the media-key count");
  if (!n_keys) return fail(n_keys.error());
  if (*n_keys > (end - off) / 4) return bad(off - 4, fmt::format("{} media keys do not fit the token words", *n_keys));
  const uint64_t keys_offset = off;
  off += uint64_t{4} * *n_keys;
  for (uint32_t i = 0; i < *n_keys; ++i) {
    if (word_at(keys_offset + uint64_t{4} * i) >= *n_ids)
      return bad(keys_offset + uint64_t{4} * i,
                 fmt::format("media key {} is {}, past the {} ids", i, word_at(keys_offset + uint64_t{4} * i), *n_ids));
    auto n_bytes = take_u32(fmt::format("media chunk {} size", i));
    if (!n_bytes) return fail(n_bytes.error());
    if (*n_bytes == 0 || *n_bytes > end - off)
      return bad(off - 4,
                 fmt::format("media chunk {} has {} bytes, {} left in the token words", i, *n_bytes, end - off));
    off += *n_bytes;
  }
  // The writer pads to whole words; a whole word more is data llama-server refuses.
  if (end - off >= 4) return bad(off, fmt::format("{} bytes after the last media chunk", end - off));
  layout.token_form = StateTokenForm::server_packed;
  layout.n_media = *n_keys;
  return {};
}

}  // namespace

const StateStream* StateBlock::filled_stream() const {
  for (const auto& stream : streams)
    if (stream.cell_count > 0) return &stream;
  return nullptr;
}

uint32_t kv_cell_record_bytes(uint32_t version, bool has_mrope_cells) {
  if (!has_mrope_cells) return static_cast<uint32_t>(kKvCellBytes);
  return static_cast<uint32_t>(kKvCellBytes + (version >= kStateSeqVersion3 ? kCellExtBytesV3 : kCellExtBytesV2));
}

Result<void> check_state_version(uint32_t version, std::string_view what) {
  if (is_known_state_version(version)) return {};
  return fail(EINVAL,
              "{}: state file version {} is unknown; llama.cpp writes version {} (llama-server before the "
              "cell token extension, e.g. d32676d) or {} (current llama-server)",
              what, version, kStateSeqVersion2, kStateSeqVersion3);
}

void assign_state_offsets(StateLayout& layout) {
  uint64_t off = kStateHeaderBytes + uint64_t{4} * layout.n_token;
  layout.tokens_offset = kStateHeaderBytes;
  if (layout.token_form == StateTokenForm::ids) {
    layout.n_prompt_ids = layout.n_token;
    layout.prompt_ids_offset = kStateHeaderBytes;
  }
  for (auto& block : layout.blocks) {
    block.offset = off;
    if (block.kind == StateBlockKind::kv) off += 4;  // n_stream
    for (auto& stream : block.streams) {
      stream.offset = off;
      off += 4;  // cell_count
      stream.cells_offset = off;
      stream.cell_count = static_cast<uint32_t>(stream.cells.size());
      off += uint64_t{stream.cell_record_bytes} * stream.cells.size();
      if (!stream.has_data) continue;
      stream.data_header_offset = off;
      off += 8;  // v_trans / s_trans, n_layer
      for (auto& section : stream.sections) {
        section.n_rows = stream.cell_count;
        section.header_offset = off;
        section.data_offset = off + kStateSectionHeaderBytes;
        off = section.end_offset();
      }
    }
    block.end_offset = off;
  }
  layout.content_bytes = off;
}

Result<StateLayout> plan_state_layout(const MemoryShape& shape, uint32_t n_token, uint32_t n_cells, uint32_t version) {
  if (auto known = check_state_version(version, "plan"); !known) return fail(known.error());
  if (n_cells > static_cast<uint32_t>(std::numeric_limits<int32_t>::max()))
    return fail(EINVAL, "{} cells: positions must fit llama_pos (int32)", n_cells);
  const BlockPlan plan = blocks_of_kind(shape.kind);
  if (plan.kv_roles.size() != shape.kv_caches.size() || plan.has_recurrent != shape.recurrent.has_value())
    return fail(EINVAL, "memory shape of kind {} has {} KV caches and {} recurrent memory; llama.cpp builds {} and {}",
                memory_kind_name(shape.kind), shape.kv_caches.size(), shape.recurrent ? "a" : "no",
                plan.kv_roles.size(), plan.has_recurrent ? "one" : "none");
  StateLayout layout;
  layout.version = version;
  layout.n_token = n_token;
  layout.memory_kind = shape.kind;
  layout.has_mrope_cells = shape.n_pos_per_embd > 1;
  for (const auto& cache : shape.kv_caches) {
    auto block = plan_kv_block(cache, n_cells, layout.has_mrope_cells, version);
    if (!block) return fail(block.error());
    layout.blocks.push_back(std::move(*block));
  }
  if (shape.recurrent) {
    auto block = plan_recurrent_block(*shape.recurrent, n_cells);
    if (!block) return fail(block.error());
    layout.blocks.push_back(std::move(*block));
  }
  assign_state_offsets(layout);
  return layout;
}

std::vector<StatePiece> encode_state_metadata(const StateLayout& layout, std::span<const int32_t> tokens) {
  std::vector<StatePiece> pieces;
  StatePiece header{0, {}};
  header.bytes.reserve(kStateHeaderBytes + 4 * tokens.size());
  put<uint32_t>(header.bytes, kStateSeqMagic);
  put<uint32_t>(header.bytes, layout.version);
  put<uint32_t>(header.bytes, layout.n_token);
  for (int32_t token : tokens) put<int32_t>(header.bytes, token);
  pieces.push_back(std::move(header));

  for (const auto& block : layout.blocks) {
    if (block.kind == StateBlockKind::kv) {
      StatePiece n_stream{block.offset, {}};
      put<uint32_t>(n_stream.bytes, block.n_stream);
      pieces.push_back(std::move(n_stream));
    }
    for (const auto& stream : block.streams) {
      StatePiece meta{stream.offset, {}};
      meta.bytes.reserve(4 + uint64_t{stream.cell_record_bytes} * stream.cells.size() + 8);
      put<uint32_t>(meta.bytes, stream.cell_count);
      for (const auto& cell : stream.cells) {
        put<int32_t>(meta.bytes, cell.pos);
        put<uint32_t>(meta.bytes, cell.n_seq_id);
        if (block.kind == StateBlockKind::kv && layout.has_mrope_cells) {
          put<int32_t>(meta.bytes, cell.ext_x);
          put<int32_t>(meta.bytes, cell.ext_y);
          if (layout.version >= kStateSeqVersion3) put<int32_t>(meta.bytes, cell.ext_tok);
        }
        if (cell.n_seq_id == 1) put<int32_t>(meta.bytes, cell.seq_id);
      }
      if (stream.has_data) {
        put<uint32_t>(meta.bytes, stream.is_transposed ? 1u : 0u);
        put<uint32_t>(meta.bytes, stream.n_layer);
      }
      pieces.push_back(std::move(meta));
      for (const auto& section : stream.sections) {
        StatePiece piece{section.header_offset, {}};
        put_section_header(piece.bytes, section);
        pieces.push_back(std::move(piece));
      }
    }
  }
  return pieces;
}

std::vector<std::byte> encode_state_file(const StateLayout& layout, std::span<const int32_t> tokens,
                                         const std::function<std::span<const std::byte>(const StateSection&)>& rows) {
  std::vector<std::byte> file(layout.content_bytes);
  for (const auto& piece : encode_state_metadata(layout, tokens))
    std::memcpy(file.data() + piece.offset, piece.bytes.data(), piece.bytes.size());
  for (const auto& block : layout.blocks)
    for (const auto& stream : block.streams)
      for (const auto& section : stream.sections) {
        const auto data = rows(section);
        const uint64_t n = std::min<uint64_t>(data.size(), section.data_bytes());
        // A section of no bytes (LFM2's 0-wide S state) may come as an empty span with no
        // address: memcpy must not see a null pointer even for 0 bytes.
        if (n > 0) std::memcpy(file.data() + section.data_offset, data.data(), n);
      }
  return file;
}

Result<StateLayout> decode_state_layout(std::span<const std::byte> file, const MemoryShape* expect,
                                        std::string_view name) {
  Cursor in(file, name);
  auto as_result = [](const ParseError& e) { return tl::unexpected<Error>(e.error); };
  auto magic = in.take<uint32_t>("magic");
  if (!magic) return as_result(magic.error());
  if (*magic != kStateSeqMagic)
    return fail(EINVAL,
                "state file {}: magic is {:#010x}, a sequence state file has {:#010x} (\"ggsq\", written by "
                "llama_state_seq_save_file) (offset 0)",
                name, *magic, kStateSeqMagic);
  auto version = in.take<uint32_t>("version");
  if (!version) return as_result(version.error());
  if (!is_known_state_version(*version))
    return fail(EINVAL, "state file {}: version is {}, this reader knows versions {} and {} (offset 4)", name, *version,
                kStateSeqVersion2, kStateSeqVersion3);
  auto n_token = in.take<uint32_t>("n_token");
  if (!n_token) return as_result(n_token.error());
  if (auto tokens = in.skip(*n_token, 4, fmt::format("the {} token ids", *n_token)); !tokens)
    return as_result(tokens.error());

  StateLayout header;
  header.version = *version;
  header.n_token = *n_token;
  if (auto form = decode_token_form(file, header, name); !form) return tl::unexpected(form.error());
  const uint64_t start = in.pos();

  if (expect) {
    auto layout = parse_memory(file, name, start, header, expect->kind, expect->n_pos_per_embd > 1, expect);
    if (!layout) return as_result(layout.error());
    return std::move(*layout);
  }

  // Inspect mode: try each reading; the first that accounts for every byte wins, else the
  // one leaving the fewest trailing bytes, else the error of the reading that got furthest.
  // A bad R/S section past the end of a reading that succeeded outranks it: a hybrid file
  // with a damaged recurrent block is not a KV file with trailing bytes.
  std::optional<StateLayout> best;
  std::optional<ParseError> furthest;
  std::optional<ParseError> recurrent_section;
  for (MemoryKind kind : {MemoryKind::kv, MemoryKind::kv_iswa, MemoryKind::hybrid, MemoryKind::hybrid_iswa,
                          MemoryKind::recurrent, MemoryKind::none}) {
    for (bool mrope : {false, true}) {
      const BlockPlan plan = blocks_of_kind(kind);
      if (mrope && plan.kv_roles.empty()) continue;
      auto layout = parse_memory(file, name, start, header, kind, mrope, nullptr);
      if (!layout) {
        // Reading plain cells as M-RoPE ones (24 or 20 bytes) walks past a bad value of the
        // plain reading before tripping on one of its own: a bad cell value under the M-RoPE
        // reading never outranks the plain reading's error.
        const bool is_mrope_misreading = mrope && layout.error().is_kv_cell_value;
        if (!is_mrope_misreading && (!furthest || layout.error().offset > furthest->offset)) furthest = layout.error();
        if (layout.error().is_recurrent_section &&
            (!recurrent_section || layout.error().offset > recurrent_section->offset))
          recurrent_section = layout.error();
        continue;
      }
      if (layout->trailing_bytes == 0) return std::move(*layout);
      if (!best || layout->trailing_bytes < best->trailing_bytes) best = std::move(*layout);
    }
  }
  if (best && recurrent_section && recurrent_section->offset > best->content_bytes)
    return as_result(*recurrent_section);
  if (best && (best->memory_kind != MemoryKind::none || !furthest)) return std::move(*best);
  if (furthest) return as_result(*furthest);
  return std::move(*best);
}

std::vector<int32_t> decode_state_tokens(std::span<const std::byte> file, const StateLayout& layout) {
  std::vector<int32_t> tokens(layout.n_prompt_ids);
  if (layout.n_prompt_ids > 0 && layout.prompt_ids_offset + uint64_t{4} * layout.n_prompt_ids <= file.size())
    std::memcpy(tokens.data(), file.data() + layout.prompt_ids_offset, tokens.size() * 4);
  return tokens;
}

Result<uint32_t> peek_state_version(std::span<const std::byte> head, std::string_view name) {
  if (head.size() < 8)
    return fail(EINVAL, "state file {}: {} bytes, too short for the magic and version (8 bytes)", name, head.size());
  uint32_t magic = 0, version = 0;
  std::memcpy(&magic, head.data(), 4);
  std::memcpy(&version, head.data() + 4, 4);
  if (magic != kStateSeqMagic)
    return fail(EINVAL, "state file {}: magic is {:#010x}, a sequence state file has {:#010x} (offset 0)", name, magic,
                kStateSeqMagic);
  if (auto known = check_state_version(version, fmt::format("state file {}", name)); !known) return fail(known.error());
  return version;
}

Result<void> set_state_version(StateLayout& layout, uint32_t version) {
  if (auto known = check_state_version(version, "set_state_version"); !known) return known;
  if (layout.n_media > 0 && version < kStateSeqVersion3)
    return fail(EINVAL,
                "the prompt holds {} media chunks (images or audio), which a version {} decoder cannot "
                "restore",
                layout.n_media, version);
  layout.version = version;
  if (layout.token_form == StateTokenForm::server_packed && version < kStateSeqVersion3) {
    layout.token_form = StateTokenForm::ids;
    layout.n_token = layout.n_prompt_ids;
  }
  for (auto& block : layout.blocks) {
    if (block.kind != StateBlockKind::kv) continue;
    for (auto& stream : block.streams) stream.cell_record_bytes = kv_cell_record_bytes(version, layout.has_mrope_cells);
  }
  assign_state_offsets(layout);
  return {};
}

void set_cell_tokens(StateLayout& layout, std::span<const int32_t> ids) {
  for (auto& block : layout.blocks) {
    if (block.kind != StateBlockKind::kv) continue;
    for (auto& stream : block.streams)
      for (auto& cell : stream.cells)
        cell.ext_tok = cell.pos >= 0 && static_cast<uint64_t>(cell.pos) < ids.size() ? ids[cell.pos] : -1;
  }
}

MemoryShape memory_shape_from_layout(const StateLayout& layout) {
  MemoryShape shape;
  shape.kind = layout.memory_kind;
  shape.n_pos_per_embd = layout.has_mrope_cells ? 4 : 1;
  for (const auto& block : layout.blocks) {
    const StateStream* filled = block.filled_stream();
    const StateStream& stream = filled ? *filled : block.streams.front();
    if (block.kind == StateBlockKind::kv) {
      KvCacheShape cache;
      cache.role = block.role;
      cache.n_stream = block.n_stream;
      cache.kv_size = std::max<uint32_t>(1, stream.cell_count);
      cache.v_trans = stream.is_transposed;
      for (const auto& section : stream.sections) {
        if (section.kind == TensorKind::k) {
          cache.type_k = section.type;
          cache.layers.push_back(KvCacheLayer{section.il, section.n_embd, 0, false});
        }
      }
      for (const auto& section : stream.sections) {
        if (section.kind != TensorKind::v) continue;
        cache.type_v = section.type;
        for (auto& layer : cache.layers)
          if (layer.il == section.il) {
            layer.n_embd_v_gqa = section.n_embd;
            layer.has_v = true;
            cache.v_width = std::max(cache.v_width, section.n_embd);
          }
      }
      shape.kv_caches.push_back(std::move(cache));
    } else {
      RecurrentShape recurrent;
      recurrent.rs_size = std::max<uint32_t>(1, stream.cell_count);
      recurrent.n_layer = stream.n_layer;
      for (const auto& section : stream.sections) {
        if (section.kind == TensorKind::r) recurrent.layers.push_back(RecurrentLayer{section.il, section.n_embd, 0});
        CacheTensor tensor;
        tensor.name = fmt::format("cache_{}_l{}", tensor_kind_name(section.kind), section.il);
        tensor.layer = section.il;
        tensor.kind = section.kind;
        tensor.type = section.type;
        recurrent.tensors.push_back(std::move(tensor));
      }
      for (const auto& section : stream.sections)
        if (section.kind == TensorKind::s)
          for (auto& layer : recurrent.layers)
            if (layer.il == section.il) layer.n_embd_s = section.n_embd;
      shape.recurrent = std::move(recurrent);
    }
  }
  return shape;
}

std::string describe_state_layout(const StateLayout& layout) {
  std::string out = fmt::format(
      "version {}, {}{}, {} tokens{}", layout.version, memory_kind_name(layout.memory_kind),
      layout.has_mrope_cells ? " (M-RoPE cells)" : "", layout.n_prompt_ids,
      layout.token_form == StateTokenForm::server_packed
          ? fmt::format(" (packed by llama-server in {} token words, {} media chunks)", layout.n_token, layout.n_media)
          : std::string());
  for (const auto& block : layout.blocks) {
    const StateStream* stream = block.filled_stream();
    if (!stream) {
      out += fmt::format("; {}: no cells", block.role);
      continue;
    }
    if (block.kind == StateBlockKind::recurrent) {
      // n_layer counts every trunk layer; only the recurrent ones have sections.
      const StateSection* r = nullptr;
      const StateSection* s = nullptr;
      uint32_t n_r = 0;
      for (const auto& section : stream->sections) {
        if (section.kind == TensorKind::r) {
          ++n_r;
          if (!r) r = &section;
        } else if (!s) {
          s = &section;
        }
      }
      out += fmt::format("; {}: {} cells x {} recurrent of {} layers", block.role, stream->cell_count, n_r,
                         stream->n_layer);
      if (r && s)
        out += fmt::format(" ({}, R row {} B, S row {} B)", ggml_type_name(r->type), r->row_bytes, s->row_bytes);
      continue;
    }
    const bool has_v = std::any_of(stream->sections.begin(), stream->sections.end(),
                                   [](const StateSection& section) { return section.kind == TensorKind::v; });
    std::string types;
    if (!stream->sections.empty()) {
      types = std::string(ggml_type_name(stream->sections.front().type));
      if (has_v) types += "/" + std::string(ggml_type_name(stream->sections.back().type));
    }
    out += fmt::format("; {}: {} cells x {} layers ({}, v_trans {})", block.role, stream->cell_count, stream->n_layer,
                       types, stream->is_transposed ? 1 : 0);
  }
  return out;
}

}  // namespace kvshare::layout
