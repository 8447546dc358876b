// Reads and validates a llama.cpp sequence-state file: the whole file comes in through large
// aligned reads (io_uring, O_DIRECT where allowed), then layout::decode_state_layout checks
// every field. Rows are handed back per section, raw or dequantized to f32.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

#include "kvshare/statefile/io_queue.h"
#include "layout/error.h"
#include "layout/memory_shape.h"
#include "layout/state_format.h"

namespace kvshare::statefile {

struct StateFileReadOptions {
  bool allow_io_uring = true;  // false: pread only (also KVSHARE_NO_IO_URING=1)
  bool allow_direct = true;    // try O_DIRECT, fall back to buffered on EINVAL
  // O_DIRECT only for files of at least this size: a smaller one is likely still in the page
  // cache (just written), where a buffered read is the fast one.
  uint64_t direct_min_bytes = uint64_t{1} << 30;
  size_t chunk_bytes = 8u << 20;  // bytes per read, a multiple of kIoAlign
  unsigned queue_depth = 4;
};

// The reader keeps the buffer of the last file it read, up to this size, for the next one:
// a decoder restores files of about the same size again and again, and a fresh buffer costs
// a page fault and a page of zeroes per 4 KiB (2 MiB with huge pages) before the first
// byte is read: on the CI VM that halved the reader's throughput for a 30 MB file.
inline constexpr size_t kKeptReadBufferBytes = 64u << 20;

// A read, validated file. Owns its bytes; spans it returns live as long as it does.
class StateFile {
 public:
  StateFile() = default;
  StateFile(StateFile&&) = default;
  StateFile& operator=(StateFile&&) = default;
  ~StateFile();  // hands a read buffer of up to kKeptReadBufferBytes back for the next read

  const std::filesystem::path& path() const { return path_; }
  const layout::StateLayout& layout() const { return layout_; }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  std::span<const std::byte> bytes() const { return {data_, size_}; }
  const IoStats& io_stats() const { return io_stats_; }

  // Every section with rows, in file order, across blocks and streams.
  std::vector<const layout::StateSection*> sections() const;
  // The section of `kind` for layer `il` (the ordinal in inspect mode); nullptr if none.
  const layout::StateSection* find_section(layout::TensorKind kind, uint32_t il) const;
  // The section's bytes exactly as stored (element-major when transposed).
  std::span<const std::byte> section_bytes(const layout::StateSection& section) const;
  // The rows in cell order, one row of section.n_embd elements of section.type per cell
  // (a transposed V section is transposed back).
  std::vector<std::byte> rows(const layout::StateSection& section) const;
  // Rows dequantized to f32, [n_rows][n_embd]. `rotation_group` > 0 undoes llama.cpp's
  // Hadamard rotation (layout::kv_rotation_group of the cache). Fails for a type
  // layout::dequantize_row cannot decode.
  Result<std::vector<float>> rows_f32(const layout::StateSection& section, int rotation_group = 0) const;

 private:
  friend Result<StateFile> read_state_file(const std::filesystem::path&, const layout::MemoryShape*,
                                           const StateFileReadOptions&);
  friend Result<StateFile> parse_state_bytes(std::vector<std::byte>, const layout::MemoryShape*, std::string);
  std::filesystem::path path_;
  AlignedBuffer buffer_;
  std::vector<std::byte> owned_;  // bytes handed in by parse_state_bytes (no aligned buffer)
  const std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  layout::StateLayout layout_;
  std::vector<int32_t> tokens_;
  IoStats io_stats_;
};

// Reads `path` and validates it against `expect` (the decoder's memory shape), or, with
// nullptr, derives the structure from the file (inspect mode). Blocks on disk reads. Fails
// with the errno of open/read (naming path and offset reached) or EINVAL with the field and
// byte offset of the first bad value, e.g. "state file slot0.bin: kv layer 12 K row size is
// 1024 bytes, layout says 512 (offset 88320)". Allocates the file's size, nothing more.
Result<StateFile> read_state_file(const std::filesystem::path& path, const layout::MemoryShape* expect,
                                  const StateFileReadOptions& options = {});

// The same validation on bytes already in memory; `name` labels errors.
Result<StateFile> parse_state_bytes(std::vector<std::byte> bytes, const layout::MemoryShape* expect, std::string name);

}  // namespace kvshare::statefile
