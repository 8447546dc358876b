// What kvshare-state does, as library functions tests can call: inspect a sequence-state
// file, verify it against a model and KV params, diff two files, convert cache types.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include "kvshare/statefile/state_file_reader.h"
#include "kvshare/statefile/state_file_writer.h"
#include "layout/error.h"
#include "layout/kv_params.h"

namespace kvshare::statefile {

// Statistics of one section's values after dequantization (rotation left in).
struct SectionStats {
  double max_abs = 0;
  double rms = 0;
  uint64_t non_finite = 0;  // NaN or Inf values
};
Result<SectionStats> section_stats(const StateFile& file, const layout::StateSection& section);

// The header, blocks, cells and per-layer types, sizes and statistics of `path`, as text or
// as one JSON object. The structure is derived from the file alone.
Result<std::string> inspect_state_file(const std::filesystem::path& path, bool json);

// Checks `state_path` against the memory llama.cpp would build for the model at `model_path`
// (GGUF metadata) with `params`: everything llama_state_seq_load_file checks, plus that the
// tokens fit the context. Returns a one-line summary; the error names the first mismatch.
Result<std::string> verify_state_file(const std::filesystem::path& state_path, const std::filesystem::path& model_path,
                                      const layout::KvParams& params);

// Head sizes for undoing / applying llama.cpp's rotation of quantized K/V caches.
struct RotationInfo {
  uint32_t n_embd_head_k = 0;  // 0: unknown (then a quantized cache is an error)
  uint32_t n_embd_head_v = 0;
  bool rotation_disabled = false;
};

struct DiffReport {
  std::string text;    // one line per section pair, then a summary
  double max_abs = 0;  // over every section, after dequantization
  bool within_tolerance = true;
};

// Compares two files section by section (same structure required: kinds, cell counts,
// positions and widths; types may differ). Values are compared after dequantization and
// un-rotation, so an f16 file and its q8_0 conversion differ by quantization noise only.
Result<DiffReport> diff_state_files(const std::filesystem::path& a, const std::filesystem::path& b, double tolerance,
                                    const RotationInfo& rotation);

struct ConvertOptions {
  // Cache types of OUT; unset keeps IN's, section by section.
  std::optional<layout::GgmlType> type_k = layout::GgmlType::F16;
  std::optional<layout::GgmlType> type_v = layout::GgmlType::F16;
  RotationInfo rotation;
  StateFileWriterOptions writer;
  // State version of OUT (2 or 3); 0 keeps IN's. Tokens are always written as plain ids.
  uint32_t to_version = 0;
};

// Rewrites `in` with other K/V cache types and/or another state version into `out`
// (atomically), keeping tokens, cells and recurrent state. Fails on a quantized transposed V (llama.cpp needs flash
// attention for a quantized V) and on quantized types without head sizes.
Result<CommitInfo> convert_state_file(const std::filesystem::path& in, const std::filesystem::path& out,
                                      const ConvertOptions& options);

}  // namespace kvshare::statefile
