// Writes GGUF v3 files (metadata, tensor infos, f32/f16/bf16/q8_0 or raw tensor data) as
// ggml's gguf_write_to_file does, to a byte sink: a vector, or a file the caller owns.
// Also writes shape-only files (gguf_write_to_file with only_meta: no data section),
// which parse_gguf reads back. Format: docs/gguf.md.
//
//   GgufWriter writer;
//   writer.add_string("general.architecture", "llama");
//   writer.add_u32("llama.block_count", 2);
//   auto ok = writer.add_tensor_from_f32("token_embd.weight", GgmlType::Q8_0, {64, 10}, weights);
//   auto bytes = writer.finish();                      // Result<std::vector<std::byte>>
//   auto ok2 = writer.write(sink);                      // or stream, one tensor at a time
//   auto shape = writer.finish(GgufPayload::kMetaOnly); // metadata + tensor infos only
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "layout/error.h"
#include "layout/gguf_reader.h"
#include "layout/gguf_value.h"

namespace kvshare::layout {

// Whether write()/finish() emit the data section.
enum class GgufPayload {
  kWithData,  // every tensor's bytes, each padded to the alignment
  kMetaOnly,  // stop after the padding that follows the tensor infos (a shape-only file)
};

// Receives the file's bytes in order. An error stops the write and is returned as is.
using GgufSink = std::function<Result<void>(std::span<const std::byte> bytes)>;
// Fills `out` (exactly the tensor's size_bytes) with its data when the writer reaches it,
// so a large model is produced one tensor at a time. Called once per write().
using GgufTensorFill = std::function<Result<void>(std::span<std::byte> out)>;

class GgufWriter {
 public:
  GgufWriter() = default;

  // --- Metadata, in insertion order (setting a key again replaces it in place). ---
  GgufMetadata& metadata() { return metadata_; }
  const GgufMetadata& metadata() const { return metadata_; }
  void set(std::string key, GgufValue value) { metadata_.set(std::move(key), std::move(value)); }
  void add_u32(std::string key, uint32_t value);
  void add_i32(std::string key, int32_t value);
  void add_u64(std::string key, uint64_t value);
  void add_f32(std::string key, float value);
  void add_bool(std::string key, bool value);
  void add_string(std::string key, std::string value);
  void add_string_array(std::string key, const std::vector<std::string>& values);
  void add_u32_array(std::string key, const std::vector<uint32_t>& values);
  void add_i32_array(std::string key, const std::vector<int32_t>& values);
  void add_f32_array(std::string key, const std::vector<float>& values);
  void add_bool_array(std::string key, const std::vector<bool>& values);

  // Sets general.alignment (u32). EINVAL unless a non-zero power of two.
  Result<void> set_alignment(uint32_t alignment);
  // The alignment the data section will use: general.alignment, else 32. EINVAL if the
  // key is there but not a u32 power of two.
  Result<uint64_t> alignment() const;
  // 3 by default; 2 writes the same layout with version 2 (re-encoding old files).
  Result<void> set_version(uint32_t version);

  // --- Tensors, in file order. `ne` lists 1 to 4 dimensions, innermost first (ggml's
  // ne[0] is the row length and must be a multiple of the type's block size). Names are
  // unique and at most 63 bytes. Every add_tensor* fails with EINVAL naming the tensor. ---

  // Raw bytes already in `type`'s encoding; exactly gguf_tensor_nbytes bytes. Copied.
  Result<void> add_tensor(std::string name, GgmlType type, const std::vector<int64_t>& ne,
                          std::span<const std::byte> data);
  // From floats, encoded as ggml would: F32 as is, F16/BF16 rounded to nearest even
  // (layout/half.h), Q8_0 as quantize_row_q8_0_ref. Other types and non-finite values
  // are EINVAL.
  Result<void> add_tensor_from_f32(std::string name, GgmlType type, const std::vector<int64_t>& ne,
                                   std::span<const float> values);
  // Data produced by `fill` while writing (nothing held in memory until then).
  Result<void> add_tensor_generated(std::string name, GgmlType type, const std::vector<int64_t>& ne,
                                    GgufTensorFill fill);
  // No data: the tensor can only be written with GgufPayload::kMetaOnly.
  Result<void> add_tensor_shape(std::string name, GgmlType type, const std::vector<int64_t>& ne);

  // The tensor infos as they will be written (offsets are the running padded sum).
  Result<std::vector<GgufTensorInfo>> tensor_infos() const;
  // Bytes write() emits for `payload`.
  Result<uint64_t> size_bytes(GgufPayload payload = GgufPayload::kWithData) const;

  // Validates everything, then emits the file to `sink`: the header and metadata in one
  // piece, then each tensor's data and padding. EINVAL (nothing emitted) for an empty key,
  // an array of arrays or with elements not of its element type, a string or array over
  // 2^30, a bad general.alignment, or kWithData when a tensor has no data.
  Result<void> write(const GgufSink& sink, GgufPayload payload = GgufPayload::kWithData) const;
  // The whole file in memory (small files and tests; stream large ones with write()).
  Result<std::vector<std::byte>> finish(GgufPayload payload = GgufPayload::kWithData) const;

  // A writer holding `file`'s version, metadata and tensors in order, with each tensor's
  // bytes copied when the image has them (shape-only otherwise): re-encoding a file
  // parse_gguf accepted gives the same bytes, padding aside (written as zeros).
  static Result<GgufWriter> from_file(const GgufFile& file);

 private:
  struct Tensor {
    GgufTensorInfo info;           // offset filled in by tensor_infos()
    std::vector<std::byte> bytes;  // owned data, or empty
    GgufTensorFill fill;           // generated data, or empty
    bool has_data = false;
  };
  Result<Tensor> make_tensor(std::string name, GgmlType type, const std::vector<int64_t>& ne) const;

  uint32_t version_ = kGgufVersion;
  GgufMetadata metadata_;
  std::vector<Tensor> tensors_;
};

// Encodes `values` as `type` (F32, F16, BF16 or Q8_0) the way ggml does; Q8_0 needs a
// multiple of 32 values. EINVAL for another type, a bad count or a non-finite value.
Result<std::vector<std::byte>> encode_f32_as(GgmlType type, std::span<const float> values);

}  // namespace kvshare::layout
