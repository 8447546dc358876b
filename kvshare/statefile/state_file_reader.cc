#include "kvshare/statefile/state_file_reader.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "kvshare/fd.h"
#include "kvshare/sys.h"
#include "layout/row_convert.h"

namespace kvshare::statefile {

using layout::StateSection;

std::vector<const StateSection*> StateFile::sections() const {
  std::vector<const StateSection*> out;
  for (const auto& block : layout_.blocks)
    for (const auto& stream : block.streams)
      for (const auto& section : stream.sections) out.push_back(&section);
  return out;
}

const StateSection* StateFile::find_section(layout::TensorKind kind, uint32_t il) const {
  for (const StateSection* section : sections())
    if (section->kind == kind && section->il == il) return section;
  return nullptr;
}

std::span<const std::byte> StateFile::section_bytes(const StateSection& section) const {
  return {data_ + section.data_offset, section.data_bytes()};
}

std::vector<std::byte> StateFile::rows(const StateSection& section) const {
  const auto stored = section_bytes(section);
  if (!section.is_transposed) return {stored.begin(), stored.end()};
  // Element-major on disk (element j of every cell): back to one row per cell.
  const uint64_t el = section.row_bytes / std::max<uint32_t>(section.n_embd, 1);
  std::vector<std::byte> out(stored.size());
  for (uint64_t j = 0; j < section.n_embd; ++j)
    for (uint64_t c = 0; c < section.n_rows; ++c)
      std::memcpy(out.data() + c * section.row_bytes + j * el, stored.data() + (j * section.n_rows + c) * el, el);
  return out;
}

Result<std::vector<float>> StateFile::rows_f32(const StateSection& section, int rotation_group) const {
  const auto raw = rows(section);
  const uint64_t row_bytes = layout::ggml_row_size(section.type, section.n_embd);
  std::vector<float> out(uint64_t{section.n_rows} * section.n_embd);
  for (uint32_t i = 0; i < section.n_rows; ++i) {
    float* dst = out.data() + uint64_t{i} * section.n_embd;
    if (!layout::dequantize_row(section.type, raw.data() + i * row_bytes, dst, section.n_embd))
      return fail(EINVAL, "state file {}: cannot dequantize {} rows (offset {})", path_.string(),
                  layout::ggml_type_name(section.type), section.header_offset);
    if (rotation_group > 0) layout::hadamard_rotate(dst, section.n_embd, rotation_group);
  }
  return out;
}

Result<StateFile> parse_state_bytes(std::vector<std::byte> bytes, const layout::MemoryShape* expect, std::string name) {
  StateFile file;
  file.path_ = name;
  file.owned_ = std::move(bytes);
  file.data_ = file.owned_.data();
  file.size_ = file.owned_.size();
  auto decoded = layout::decode_state_layout(file.bytes(), expect, name);
  if (!decoded) return fail(decoded.error());
  file.layout_ = std::move(*decoded);
  file.tokens_ = layout::decode_state_tokens(file.bytes(), file.layout_);
  return file;
}

namespace {

// The last file's buffer, for the next read (see kKeptReadBufferBytes).
AlignedBufferPool& read_buffers() {
  static AlignedBufferPool pool(1, kKeptReadBufferBytes);
  return pool;
}

}  // namespace

StateFile::~StateFile() { read_buffers().give(std::move(buffer_)); }

Result<StateFile> read_state_file(const std::filesystem::path& path, const layout::MemoryShape* expect,
                                  const StateFileReadOptions& options) {
  if (options.chunk_bytes == 0 || options.chunk_bytes % kIoAlign != 0)
    return fail(EINVAL, "state file {}: read chunk_bytes {} is not a positive multiple of {}", path.string(),
                options.chunk_bytes, kIoAlign);
  const int base_flags = O_RDONLY | O_CLOEXEC;
  bool is_direct = false;
  int raw = -1;
  struct stat before {};
  const bool large =
      ::stat(path.c_str(), &before) == 0 && static_cast<uint64_t>(before.st_size) >= options.direct_min_bytes;
  if (options.allow_direct && large) {
    raw = sys::ops().open(path.c_str(), base_flags | O_DIRECT, 0);
    is_direct = raw >= 0;
    if (raw < 0 && errno != EINVAL) return fail(errno, "state file {}: open for reading", path.string());
  }
  if (raw < 0) raw = sys::ops().open(path.c_str(), base_flags, 0);
  if (raw < 0) return fail(errno, "state file {}: open for reading", path.string());
  Fd fd(raw);

  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return fail(errno, "state file {}: fstat", path.string());
  if (!S_ISREG(st.st_mode)) return fail(EINVAL, "state file {}: not a regular file", path.string());
  const auto size = static_cast<uint64_t>(st.st_size);

  // The allocation follows the file's real size, never a field inside it.
  auto buffer = read_buffers().take(size);
  if (!buffer) return fail(buffer.error().with_context(fmt::format("state file {}", path.string())));
  auto queue = IoQueue::create(fd.get(), path.string(), is_direct, options.queue_depth, options.allow_io_uring);
  if (!queue) return fail(queue.error());

  // O_DIRECT reads whole aligned blocks; the last one stops at the end of the file, so it
  // asks for the rounded length and is complete once the real bytes arrived.
  for (uint64_t offset = 0; offset < size; offset += options.chunk_bytes) {
    const uint64_t want = std::min<uint64_t>(options.chunk_bytes, size - offset);
    IoRequest request;
    request.data = buffer->data() + offset;
    request.length = (want + kIoAlign - 1) / kIoAlign * kIoAlign;
    request.min_bytes = want;
    request.offset = offset;
    request.is_write = false;
    if (auto rc = (*queue)->submit(request); !rc) return fail(rc.error());
  }
  if (auto rc = (*queue)->drain(); !rc) return fail(rc.error());

  StateFile file;
  file.path_ = path;
  file.io_stats_ = (*queue)->stats();
  file.buffer_ = std::move(*buffer);
  file.data_ = file.buffer_.data();
  file.size_ = size;
  auto decoded = layout::decode_state_layout(file.bytes(), expect, path.string());
  if (!decoded) return fail(decoded.error());
  file.layout_ = std::move(*decoded);
  file.tokens_ = layout::decode_state_tokens(file.bytes(), file.layout_);
  return file;
}

}  // namespace kvshare::statefile
