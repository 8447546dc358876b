#include "kvshare/statefile/state_file_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <vector>

#include "kvshare/fd.h"
#include "kvshare/sys.h"
#include "layout/row_convert.h"

namespace kvshare::statefile {

using layout::GgmlType;
using layout::StateLayout;
using layout::StateSection;
using layout::TensorKind;

namespace {

uint64_t align_down(uint64_t value) { return value / kIoAlign * kIoAlign; }
uint64_t align_up(uint64_t value) { return (value + kIoAlign - 1) / kIoAlign * kIoAlign; }

std::string section_name(TensorKind kind, uint32_t il) {
  std::string kind_name(layout::tensor_kind_name(kind));
  for (char& c : kind_name) c = static_cast<char>(std::toupper(c));
  return fmt::format("layer {} {}", il, kind_name);
}

std::filesystem::path temporary_path_for(const std::filesystem::path& path) {
  static std::atomic<unsigned> counter{0};
  const auto name = fmt::format(".{}.{}.{}.tmp", path.filename().string(), ::getpid(), counter.fetch_add(1));
  return path.parent_path().empty() ? std::filesystem::path(name) : path.parent_path() / name;
}

// Staging buffers outlive a writer: a provider writes one file per prompt.
AlignedBufferPool& staging_buffers() {
  static AlignedBufferPool pool(16, kDirectChunkBytes);
  return pool;
}

}  // namespace

bool attn_rotation_disabled_by_env() {
  const char* value = std::getenv("LLAMA_ATTN_ROT_DISABLE");
  return value != nullptr && std::atoi(value) != 0;  // llama.cpp: atoi(LLAMA_ATTN_ROT_DISABLE)
}

struct StateFileWriter::Impl {
  struct Section {
    const StateSection* section = nullptr;
    size_t region = 0;
    bool is_written = false;
    int rotation_group = 0;  // -1: quantized and the head size is unknown
  };
  struct Region {
    uint64_t start = 0;
    uint64_t end = 0;
    std::vector<size_t> sections;  // ascending offset
    size_t next_section = 0;
    std::vector<size_t> pieces;  // ascending offset
    size_t next_piece = 0;
    int buffer = -1;            // pool index of the staging buffer, -1 none
    uint64_t buffer_start = 0;  // file offset of the staging buffer's first byte (aligned)
    uint64_t pos = 0;           // next file offset to fill
  };

  std::filesystem::path path;
  std::filesystem::path temp_path;
  StateFileWriterOptions options;
  StateLayout layout;
  std::vector<layout::StatePiece> pieces;
  std::vector<Section> sections;
  std::vector<Region> regions;
  Fd fd;
  bool opened_direct = false;
  std::unique_ptr<IoQueue> queue;
  std::vector<AlignedBuffer> pool;
  std::vector<int> free_buffers;
  std::map<uint64_t, AlignedBuffer> edges;  // partial 4 KiB blocks where regions meet, by block offset
  std::vector<std::byte> scratch;           // one converted row that straddles two staging buffers
  std::vector<std::byte> transpose_buffer;  // one layer's V rows before the element-major copy
  bool is_spent = false;
  IoStats final_stats;  // the queue's counts, kept after commit() releases the queue

  ~Impl() {
    abandon();
    for (auto& buffer : pool) staging_buffers().give(std::move(buffer));
  }

  // Removes the temporary file; used on failure and when a writer is dropped uncommitted.
  void abandon() {
    if (is_spent) return;
    is_spent = true;
    queue.reset();  // waits for writes still in the kernel: their buffers are about to go
    fd.reset();
    if (!temp_path.empty()) sys::ops().unlink(temp_path.c_str());
  }

  template <class T>
  Result<T> spend_on_error(Result<T> result) {
    if (!result) abandon();
    return result;
  }

  std::string file_label() const { return fmt::format("state file {}", path.string()); }

  Result<int> acquire_buffer() {
    while (free_buffers.empty()) {
      if (queue->in_flight() == 0) {
        auto buffer = staging_buffers().take(options.chunk_bytes);
        if (!buffer) return fail(buffer.error());
        pool.push_back(std::move(*buffer));
        free_buffers.push_back(static_cast<int>(pool.size() - 1));
        break;
      }
      auto done = queue->wait();
      if (!done) return fail(done.error().with_context(file_label()));
      if (done->tag != kEdgeTag) free_buffers.push_back(static_cast<int>(done->tag));
    }
    const int index = free_buffers.back();
    free_buffers.pop_back();
    return index;
  }

  static constexpr uint64_t kEdgeTag = ~uint64_t{0};

  void add_edge(uint64_t lo, uint64_t hi, const std::byte* bytes) {
    while (lo < hi) {
      const uint64_t block = align_down(lo);
      const uint64_t stop = std::min(hi, block + kIoAlign);
      auto it = edges.find(block);
      if (it == edges.end()) {
        it = edges.emplace(block, *AlignedBuffer::allocate(kIoAlign)).first;
        std::memset(it->second.data(), 0, kIoAlign);  // bytes past the file's end, cut off later
      }
      std::memcpy(it->second.data() + (lo - block), bytes, stop - lo);
      bytes += stop - lo;
      lo = stop;
    }
  }

  // Writes the staging buffer's bytes [max(buffer_start, start), pos): whole aligned blocks
  // go to the queue, the partial blocks at the region's two ends become edges.
  Result<void> flush(Region& region, bool is_final) {
    if (region.buffer < 0) return {};
    const int index = region.buffer;
    region.buffer = -1;
    std::byte* base = pool[static_cast<size_t>(index)].data();
    const uint64_t buffer_start = region.buffer_start;
    const uint64_t lo = std::max(buffer_start, region.start);
    const uint64_t hi = region.pos;
    const uint64_t direct_lo = align_up(lo);
    const uint64_t direct_hi = is_final ? align_down(hi) : hi;
    if (lo < hi) {
      if (lo != direct_lo) add_edge(lo, std::min(hi, direct_lo), base + (lo - buffer_start));
      if (direct_hi < hi && direct_hi >= direct_lo) add_edge(direct_hi, hi, base + (direct_hi - buffer_start));
    }
    if (!is_final) region.buffer_start += options.chunk_bytes;
    if (hi <= lo || direct_hi <= direct_lo) {
      free_buffers.push_back(index);
      return {};
    }
    IoRequest request;
    request.data = base + (direct_lo - buffer_start);
    request.length = direct_hi - direct_lo;
    request.offset = direct_lo;
    request.is_write = true;
    request.tag = static_cast<uint64_t>(index);
    if (auto rc = queue->submit(request); !rc) return fail(rc.error().with_context(file_label()));
    return {};
  }

  // The writable rest of the region's staging buffer (never empty).
  Result<std::span<std::byte>> window(Region& region) {
    if (region.buffer < 0) {
      auto index = acquire_buffer();
      if (!index) return fail(index.error());
      region.buffer = *index;
    }
    const uint64_t used = region.pos - region.buffer_start;
    return std::span<std::byte>(pool[static_cast<size_t>(region.buffer)].data() + used, options.chunk_bytes - used);
  }

  Result<void> advance(Region& region, uint64_t n) {
    region.pos += n;
    if (region.pos == region.buffer_start + options.chunk_bytes) return flush(region, false);
    return {};
  }

  Result<void> put_bytes(Region& region, const std::byte* bytes, uint64_t n) {
    while (n > 0) {
      auto span = window(region);
      if (!span) return fail(span.error());
      const uint64_t take = std::min<uint64_t>(n, span->size());
      std::memcpy(span->data(), bytes, take);
      bytes += take;
      n -= take;
      if (auto rc = advance(region, take); !rc) return rc;
    }
    return {};
  }

  Result<void> emit_pieces_before(Region& region, uint64_t offset) {
    while (region.next_piece < region.pieces.size()) {
      const auto& piece = pieces[region.pieces[region.next_piece]];
      if (piece.offset >= offset) break;
      if (piece.offset != region.pos)
        return fail(EFAULT, "{}: metadata at offset {} but the region is at {}", file_label(), piece.offset,
                    region.pos);
      if (auto rc = put_bytes(region, piece.bytes.data(), piece.bytes.size()); !rc) return rc;
      ++region.next_piece;
    }
    return {};
  }

  // Converts (or copies) `n_embd` elements of one source row into `dst`.
  static void convert_one(const RowsView& rows, const std::byte* src, const StateSection& section, std::byte* dst,
                          int rotation_group) {
    if (rows.type == section.type) {
      std::memcpy(dst, src, layout::ggml_row_size(section.type, section.n_embd));
      return;
    }
    layout::convert_row(rows.type, src, section.type, dst, section.n_embd, rotation_group);
  }

  Result<void> write_rows(Region& region, const Section& entry, const RowsView& rows) {
    const StateSection& section = *entry.section;
    const std::byte* src = static_cast<const std::byte*>(rows.data);
    const uint64_t src_row_bytes = layout::ggml_row_size(rows.type, section.n_embd);
    const uint64_t stride = rows.row_stride_bytes ? rows.row_stride_bytes : src_row_bytes;
    src += stride * (rows.n_rows - section.n_rows);  // keep the last n_rows (window / last state)

    if (!section.is_transposed) {
      const uint64_t row_bytes = section.row_bytes;
      for (uint32_t i = 0; i < section.n_rows; ++i, src += stride) {
        auto span = window(region);
        if (!span) return fail(span.error());
        if (span->size() >= row_bytes) {
          convert_one(rows, src, section, span->data(), entry.rotation_group);
          if (auto rc = advance(region, row_bytes); !rc) return rc;
        } else {
          scratch.resize(row_bytes);
          convert_one(rows, src, section, scratch.data(), entry.rotation_group);
          if (auto rc = put_bytes(region, scratch.data(), row_bytes); !rc) return rc;
        }
      }
      return {};
    }

    // Mirrors llama_kv_cache::state_write_data with v_trans: element j of every cell, then
    // element j+1. Convert the layer's rows once, then copy element-major.
    const uint64_t el = static_cast<uint64_t>(layout::ggml_traits(section.type).type_size);
    const uint64_t row_bytes = section.row_bytes;
    transpose_buffer.resize(row_bytes * section.n_rows);
    for (uint32_t i = 0; i < section.n_rows; ++i, src += stride)
      convert_one(rows, src, section, transpose_buffer.data() + i * row_bytes, entry.rotation_group);
    const uint64_t n_cells = section.n_rows;
    uint64_t out_index = 0;  // element-major index: j * n_cells + c
    const uint64_t total = uint64_t{section.n_embd} * n_cells;
    while (out_index < total) {
      auto span = window(region);
      if (!span) return fail(span.error());
      const uint64_t count = std::min<uint64_t>(span->size() / el, total - out_index);
      if (count == 0) {
        // Fewer than `el` bytes left in this buffer: go through the byte path.
        const uint64_t j = out_index / n_cells, c = out_index % n_cells;
        if (auto rc = put_bytes(region, transpose_buffer.data() + c * row_bytes + j * el, el); !rc) return rc;
        ++out_index;
        continue;
      }
      std::byte* out = span->data();
      for (uint64_t k = 0; k < count; ++k, ++out_index) {
        const uint64_t j = out_index / n_cells, c = out_index % n_cells;
        std::memcpy(out + k * el, transpose_buffer.data() + c * row_bytes + j * el, el);
      }
      if (auto rc = advance(region, count * el); !rc) return rc;
    }
    return {};
  }

  Result<void> write_section(TensorKind kind, uint32_t il, const RowsView& rows) {
    if (is_spent) return fail(EINVAL, "{}: the writer already committed or failed", file_label());
    auto it = std::find_if(sections.begin(), sections.end(),
                           [&](const Section& s) { return s.section->kind == kind && s.section->il == il; });
    if (it == sections.end())
      return fail(EINVAL, "{}: {} is not in this file's layout (not an owned layer of that kind)", file_label(),
                  section_name(kind, il));
    Section& entry = *it;
    const StateSection& section = *entry.section;
    if (entry.is_written) return fail(EINVAL, "{}: {} was already written", file_label(), section_name(kind, il));
    Region& region = regions[entry.region];
    const size_t index = static_cast<size_t>(it - sections.begin());
    if (region.sections[region.next_section] != index && region.sections[region.next_section] != SIZE_MAX) {
      const StateSection& due = *sections[region.sections[region.next_section]].section;
      return fail(EINVAL, "{}: {} handed before {}: each of K, V, R and S goes in ascending layer order", file_label(),
                  section_name(kind, il), section_name(due.kind, due.il));
    }
    if (rows.type != section.type && !layout::is_source_type(rows.type))
      return fail(EINVAL, "{}: {} rows are {}, the writer takes f32, f16, bf16 or the cache type {}", file_label(),
                  section_name(kind, il), layout::ggml_type_name(rows.type), layout::ggml_type_name(section.type));
    if (rows.n_rows < section.n_rows)
      return fail(EINVAL, "{}: {} got {} rows, the file holds {}", file_label(), section_name(kind, il), rows.n_rows,
                  section.n_rows);
    if (rows.n_rows > 0 && rows.data == nullptr)
      return fail(EINVAL, "{}: {} rows have no data pointer", file_label(), section_name(kind, il));
    if (rows.type != section.type && entry.rotation_group < 0)
      return fail(EINVAL,
                  "{}: {} is quantized to {}: the writer needs the head size (n_embd_head_{}) to apply llama.cpp's "
                  "Hadamard rotation",
                  file_label(), section_name(kind, il), layout::ggml_type_name(section.type),
                  kind == TensorKind::k ? "k" : "v");
    const uint64_t packed = layout::ggml_row_size(rows.type, section.n_embd);
    if (rows.row_stride_bytes != 0 && rows.row_stride_bytes < packed)
      return fail(EINVAL, "{}: {} row stride {} is smaller than a row ({} bytes)", file_label(), section_name(kind, il),
                  rows.row_stride_bytes, packed);

    auto rc = emit_pieces_before(region, section.data_offset);
    if (rc && region.pos != section.data_offset)
      rc = fail(EFAULT, "{}: {} data at offset {} but the region is at {}", file_label(), section_name(kind, il),
                section.data_offset, region.pos);
    if (rc) rc = write_rows(region, entry, rows);
    if (!rc) {
      abandon();
      return rc;
    }
    entry.is_written = true;
    ++region.next_section;
    return {};
  }

  Result<CommitInfo> commit() {
    if (is_spent) return fail(EINVAL, "{}: the writer already committed or failed", file_label());
    for (const auto& entry : sections)
      if (!entry.is_written) {
        abandon();
        return fail(EINVAL, "{}: {} was never written (commit needs every section)", file_label(),
                    section_name(entry.section->kind, entry.section->il));
      }
    return spend_on_error(finish());
  }

  Result<CommitInfo> finish() {
    for (auto& region : regions) {
      if (auto rc = emit_pieces_before(region, region.end); !rc) return fail(rc.error());
      if (region.pos != region.end)
        return fail(EFAULT, "{}: region [{}, {}) filled to {}", file_label(), region.start, region.end, region.pos);
      if (auto rc = flush(region, true); !rc) return fail(rc.error());
    }
    for (auto& [block, buffer] : edges) {
      IoRequest request;
      request.data = buffer.data();
      request.length = kIoAlign;
      request.offset = block;
      request.tag = kEdgeTag;
      if (auto rc = queue->submit(request); !rc) return fail(rc.error().with_context(file_label()));
    }
    if (auto rc = queue->drain(); !rc) return fail(rc.error().with_context(file_label()));
    // The last edge block runs past the end: cut the file to the exact size llama.cpp wrote.
    if (sys::ops().ftruncate(fd.get(), static_cast<off_t>(layout.content_bytes)) != 0)
      return fail(errno, "{}: ftruncate of {} to {} bytes", file_label(), temp_path.string(), layout.content_bytes);
    if (options.fsync != FsyncPolicy::none && sys::ops().fsync(fd.get()) != 0)
      return fail(errno, "{}: fsync of {}", file_label(), temp_path.string());
    CommitInfo info;
    final_stats = queue->stats();
    info.io_backend = queue->backend_name();
    info.is_direct = opened_direct && !queue->stats().fell_back_to_buffered;
    queue.reset();
    if (sys::ops().close(fd.release()) != 0)
      return fail(errno, "{}: close of {} (data may not have reached the file)", file_label(), temp_path.string());
    if (sys::ops().rename(temp_path.c_str(), path.c_str()) != 0)
      return fail(errno, "{}: rename from {}", file_label(), temp_path.string());
    temp_path.clear();  // it is the final file now: abandon() must not remove it
    is_spent = true;
    if (options.fsync == FsyncPolicy::data_and_directory) {
      const auto dir = path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
      Fd dir_fd(sys::ops().open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0));
      if (!dir_fd || sys::ops().fsync(dir_fd.get()) != 0)
        return fail(errno, "{}: fsync of directory {} after the rename", file_label(), dir.string());
    }
    info.path = path;
    info.size_bytes = layout.content_bytes;
    info.state_version = layout.version;
    return info;
  }

  Result<void> open_and_plan(std::span<const int32_t> tokens) {
    if (options.chunk_bytes % kIoAlign != 0)
      return fail(EINVAL, "state file writer: chunk_bytes {} is not 0 (automatic) or a multiple of {}",
                  options.chunk_bytes, kIoAlign);
    if (tokens.size() != layout.n_token)
      return fail(EINVAL, "{}: {} tokens given, the layout has {}", file_label(), tokens.size(), layout.n_token);
    pieces = layout::encode_state_metadata(layout, tokens);

    // Region starts: the file start, each later block, each stream's first V / S header.
    std::vector<uint64_t> starts{0};
    for (size_t b = 0; b < layout.blocks.size(); ++b) {
      const auto& block = layout.blocks[b];
      if (b > 0) starts.push_back(block.offset);
      for (const auto& stream : block.streams)
        for (const auto& section : stream.sections)
          if (section.kind == TensorKind::v || section.kind == TensorKind::s) {
            starts.push_back(section.header_offset);
            break;
          }
    }
    std::sort(starts.begin(), starts.end());
    starts.erase(std::unique(starts.begin(), starts.end()), starts.end());
    for (size_t i = 0; i < starts.size(); ++i) {
      Region region;
      region.start = starts[i];
      region.end = i + 1 < starts.size() ? starts[i + 1] : layout.content_bytes;
      region.pos = region.start;
      region.buffer_start = align_down(region.start);
      regions.push_back(region);
    }
    auto region_of = [&](uint64_t offset) {
      return static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), offset) - starts.begin() - 1);
    };
    for (size_t i = 0; i < pieces.size(); ++i) regions[region_of(pieces[i].offset)].pieces.push_back(i);

    const bool rotation_off = options.rotation_disabled;
    for (const auto& block : layout.blocks)
      for (const auto& stream : block.streams)
        for (const auto& section : stream.sections) {
          Section entry;
          entry.section = &section;
          entry.region = region_of(section.header_offset);
          // Nothing to hand when the section has no row bytes: no cells, or rows of width 0
          // (LFM2's S, whose header llama.cpp writes with row size 0): the header says it all.
          entry.is_written = section.data_bytes() == 0;
          if (layout::is_quantized(section.type) && (section.kind == TensorKind::k || section.kind == TensorKind::v)) {
            const uint32_t head = section.kind == TensorKind::k ? options.n_embd_head_k : options.n_embd_head_v;
            entry.rotation_group = head == 0 && !rotation_off
                                       ? -1
                                       : layout::kv_rotation_group(section.kind, section.type, head, rotation_off);
          }
          sections.push_back(entry);
        }
    // Within a region, sections go in file order.
    for (size_t i = 0; i < sections.size(); ++i) regions[sections[i].region].sections.push_back(i);
    for (auto& region : regions) {
      std::sort(region.sections.begin(), region.sections.end(), [&](size_t a, size_t b) {
        return sections[a].section->header_offset < sections[b].section->header_offset;
      });
      // Sections with no rows are already complete: skip them in the order check.
      std::erase_if(region.sections, [&](size_t i) { return sections[i].is_written; });
      region.sections.push_back(SIZE_MAX);  // sentinel: nothing more due
    }

    // Open the temporary file beside the target so the rename stays in one filesystem.
    temp_path = temporary_path_for(path);
    const int base_flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC;
    int raw = -1;
    if (options.allow_direct && layout.content_bytes >= options.direct_min_bytes) {
      raw = sys::ops().open(temp_path.c_str(), base_flags | O_DIRECT, 0644);
      opened_direct = raw >= 0;
      if (raw < 0 && errno != EINVAL) {
        const int error = errno;
        temp_path.clear();
        return fail(error, "{}: creating temporary file beside it", file_label());
      }
    }
    if (raw < 0) raw = sys::ops().open(temp_path.c_str(), base_flags, 0644);
    if (raw < 0) {
      const int error = errno;
      temp_path.clear();
      return fail(error, "{}: creating temporary file beside it", file_label());
    }
    fd.reset(raw);
    // io_uring for O_DIRECT only: a buffered write to a regular file is punted to io_uring's
    // own worker threads, which made the writer slower than pwrite from this thread. A
    // worker thread of our own doing the pwrites was slower still: the copy into the page
    // cache then reads staging bytes another core wrote. Buffered staging chunks are small
    // enough to stay in L2 between the conversion that writes them and the pwrite that
    // copies them out; O_DIRECT wants large transfers. The paired runs of kvshare-bench
    // statefile that chose each: docs/state-file.md, "Writing: streaming, atomic, io_uring".
    if (options.chunk_bytes == 0) options.chunk_bytes = opened_direct ? kDirectChunkBytes : kBufferedChunkBytes;
    auto created = IoQueue::create(fd.get(), temp_path.string(), opened_direct, options.queue_depth,
                                   options.allow_io_uring && opened_direct);
    if (!created) return fail(created.error());
    queue = std::move(*created);
    return {};
  }
};

StateFileWriter::StateFileWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
StateFileWriter::StateFileWriter(StateFileWriter&&) noexcept = default;
StateFileWriter& StateFileWriter::operator=(StateFileWriter&&) noexcept = default;
StateFileWriter::~StateFileWriter() = default;

Result<StateFileWriter> StateFileWriter::create(const std::filesystem::path& path, const layout::MemoryShape& shape,
                                                std::span<const int32_t> tokens, int32_t n_cells,
                                                const StateFileWriterOptions& options) {
  if (n_cells < 0) return fail(EINVAL, "state file {}: n_cells is {}, negative", path.string(), n_cells);
  auto planned = layout::plan_state_layout(shape, static_cast<uint32_t>(tokens.size()), static_cast<uint32_t>(n_cells),
                                           options.state_version);
  if (!planned) return fail(planned.error().with_context(fmt::format("state file {}", path.string())));
  layout::set_cell_tokens(*planned, tokens);
  return create_for_layout(path, std::move(*planned), tokens, options);
}

Result<StateFileWriter> StateFileWriter::create_for_layout(const std::filesystem::path& path,
                                                           layout::StateLayout layout, std::span<const int32_t> tokens,
                                                           const StateFileWriterOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  impl->options = options;
  impl->layout = std::move(layout);
  if (auto rc = impl->open_and_plan(tokens); !rc) {
    impl->abandon();
    return fail(rc.error());
  }
  return StateFileWriter(std::move(impl));
}

Result<void> StateFileWriter::write_layer(uint32_t il, const RowsView& k, const RowsView& v) {
  if (auto rc = write_section(TensorKind::k, il, k); !rc) return rc;
  const bool has_v = std::any_of(impl_->sections.begin(), impl_->sections.end(), [&](const Impl::Section& s) {
    return s.section->kind == TensorKind::v && s.section->il == il;
  });
  if (!has_v) return {};
  return write_section(TensorKind::v, il, v);
}

Result<void> StateFileWriter::write_recurrent_layer(uint32_t il, const RowsView& r, const RowsView& s) {
  if (auto rc = write_section(TensorKind::r, il, r); !rc) return rc;
  return write_section(TensorKind::s, il, s);
}

Result<void> StateFileWriter::write_section(TensorKind kind, uint32_t il, const RowsView& rows) {
  // Sections without row bytes are complete at planning time; handing one (any rows, or an
  // empty view) is harmless.
  for (const auto& entry : impl_->sections)
    if (entry.section->kind == kind && entry.section->il == il && entry.section->data_bytes() == 0) return {};
  return impl_->write_section(kind, il, rows);
}

Result<CommitInfo> StateFileWriter::commit() { return impl_->commit(); }
const StateLayout& StateFileWriter::layout() const { return impl_->layout; }
const std::filesystem::path& StateFileWriter::path() const { return impl_->path; }
const IoStats& StateFileWriter::io_stats() const { return impl_->queue ? impl_->queue->stats() : impl_->final_stats; }

}  // namespace kvshare::statefile
