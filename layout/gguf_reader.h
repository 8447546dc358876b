// Reads a GGUF v2/v3 file image (header, metadata, tensor infos) from bytes the caller
// mapped (kvshare::Mapping::map_file_readonly), with the checks ggml's gguf.cpp makes
// and strict bounds checks. Touches no tensor data until tensor_data() is asked.
// Format and error handling: docs/gguf.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "layout/error.h"
#include "layout/gguf_value.h"

namespace kvshare::layout {

// Limits and defaults of ggml/src/gguf.cpp and ggml/include/gguf.h.
inline constexpr uint32_t kGgufVersion = 3;                    // the newest version; 2 reads the same
inline constexpr uint32_t kGgufDefaultAlignment = 32;          // GGUF_DEFAULT_ALIGNMENT
inline constexpr uint64_t kGgufMaxStringLength = 1ull << 30;   // GGUF_MAX_STRING_LENGTH
inline constexpr uint64_t kGgufMaxArrayElements = 1ull << 30;  // GGUF_MAX_ARRAY_ELEMENTS
inline constexpr size_t kGgufMaxTensorNameLength = 63;         // GGML_MAX_NAME (64) - 1
inline constexpr uint32_t kGgufMaxDims = 4;                    // GGML_MAX_DIMS
inline constexpr std::string_view kGgufAlignmentKey = "general.alignment";

// A parsed GGUF image. `data` borrows the caller's bytes: keep the mapping alive as long
// as tensor_data() results are used.
struct GgufFile {
  std::string name;  // as given to parse_gguf, for messages
  uint32_t version = kGgufVersion;
  GgufMetadata metadata;
  std::vector<GgufTensorInfo> tensors;  // in file order
  uint64_t alignment = kGgufDefaultAlignment;
  uint64_t data_offset = 0;         // byte offset of the data section in the file (aligned when there are tensors)
  uint64_t data_size = 0;           // bytes the data section holds when complete: every tensor padded to `alignment`
  std::span<const std::byte> data;  // the whole file image, not only the data section

  // True when the image holds every tensor's bytes; false for a shape-only file
  // (metadata and tensor infos, no data section) or one whose data was cut short.
  bool has_tensor_data() const { return data.size() >= data_offset && data.size() - data_offset >= data_size; }
  const GgufTensorInfo* find_tensor(std::string_view tensor_name) const;
};

// Parses `bytes` (the whole file; `name` is the path or label used in messages).
// Every refusal is EINVAL with a message "GGUF <name>: <what> at byte offset <n>", naming
// the key or tensor involved: bad magic, version 0, 1 or > 3, truncation anywhere before
// the data section, counts the remaining bytes cannot hold, strings over 2^30 bytes,
// arrays over 2^30 elements or of arrays, unknown value or ggml type ids, empty or
// duplicate keys, general.alignment not a u32 power of two, tensor names of 64+ bytes or
// duplicated, n_dims > 4, negative or overflowing dimensions, ne[0] not a multiple of
// the block size, and offsets that are not the running padded sum ggml requires.
// A file whose data section is absent or short parses (shape-only GGUFs are valid);
// tensor_data() then refuses the tensors that are not there.
// Allocates at most a constant factor of bytes.size() (every element read consumes bytes).
Result<GgufFile> parse_gguf(std::span<const std::byte> bytes, std::string_view name);

// The bytes of `tensor` (one of file.tensors) inside the image: size_bytes bytes at
// data_offset + offset. ENODATA when they lie past the end of the image (shape-only or
// truncated file), naming the tensor, the byte range and the image size.
Result<std::span<const std::byte>> tensor_data(const GgufFile& file, const GgufTensorInfo& tensor);

// ggml_nbytes of a contiguous tensor: ne[0]/block * type_size * ne[1] * ne[2] * ne[3].
// EINVAL when ne[0] is not a multiple of the block size, a dimension is negative or the
// size overflows 64 bits.
Result<uint64_t> gguf_tensor_nbytes(GgmlType type, const std::array<int64_t, 4>& ne);

// GGML_PAD: `offset` rounded up to `alignment` (a power of two). Callers check overflow.
inline uint64_t gguf_pad(uint64_t offset, uint64_t alignment) { return (offset + alignment - 1) & ~(alignment - 1); }

}  // namespace kvshare::layout
