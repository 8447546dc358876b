// GGUF metadata as values: what the reader produces, the writer consumes and the model
// shape is derived from. Pure data; parsing lives in gguf_reader.h, writing in gguf_writer.h.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "layout/error.h"
#include "layout/tensor_type.h"

namespace kvshare::layout {

// gguf_type ids (ggml/include/gguf.h); written to files: never renumber.
enum class GgufValueType : uint32_t {
  UINT8 = 0,
  INT8 = 1,
  UINT16 = 2,
  INT16 = 3,
  UINT32 = 4,
  INT32 = 5,
  FLOAT32 = 6,
  BOOL = 7,
  STRING = 8,
  ARRAY = 9,
  UINT64 = 10,
  INT64 = 11,
  FLOAT64 = 12,
};
std::string_view gguf_value_type_name(GgufValueType type);

struct GgufValue;

// An array value. Arrays of arrays are not valid GGUF (the reader refuses them).
struct GgufArray {
  GgufValueType element_type = GgufValueType::UINT8;
  std::vector<GgufValue> elements;
};

// One metadata value. The variant's alternatives are in gguf_type order, so
// `type()` is the alternative index.
struct GgufValue {
  using Storage = std::variant<uint8_t, int8_t, uint16_t, int16_t, uint32_t, int32_t, float, bool, std::string,
                               GgufArray, uint64_t, int64_t, double>;
  Storage value;

  GgufValueType type() const { return static_cast<GgufValueType>(value.index()); }
  template <class T>
  const T* get_if() const {
    return std::get_if<T>(&value);
  }
};

// The key/value section of a GGUF file, in file order. Lookups are by exact key.
class GgufMetadata {
 public:
  // Adds or replaces `key` (a replaced key keeps its position).
  void set(std::string key, GgufValue value);
  // Appends `key` without looking for it: for a reader that has already proven the key
  // unique (set() is a linear search, quadratic over a file's keys).
  void append_unique(std::string key, GgufValue value) { entries_.emplace_back(std::move(key), std::move(value)); }
  const GgufValue* find(std::string_view key) const;
  bool contains(std::string_view key) const { return find(key) != nullptr; }
  const std::vector<std::pair<std::string, GgufValue>>& entries() const { return entries_; }

  // Strict getters, as llama.cpp reads keys: the stored type must be exactly the one
  // asked for, else an error naming the key, the expected and the actual type. A missing
  // key is an ENOENT error naming the key.
  Result<uint32_t> get_u32(std::string_view key) const;
  Result<float> get_f32(std::string_view key) const;
  Result<bool> get_bool(std::string_view key) const;
  Result<std::string> get_string(std::string_view key) const;
  Result<const GgufArray*> get_array(std::string_view key) const;
  // The key if present (with the strict type check), nullopt if absent.
  Result<std::optional<uint32_t>> find_u32(std::string_view key) const;
  Result<std::optional<float>> find_f32(std::string_view key) const;

  // llama.cpp's per-layer read (get_key_or_arr): a UINT32 scalar broadcast to every layer
  // (llama.cpp's get_key<uint32_t> refuses an INT32 scalar, so do we), or an array of
  // exactly `n_layer` BOOL/INT32/UINT32 elements. Absent: nullopt.
  Result<std::optional<std::vector<uint32_t>>> find_per_layer(std::string_view key, uint32_t n_layer) const;

 private:
  std::vector<std::pair<std::string, GgufValue>> entries_;
};

// One tensor info record. `ne` has 1 in the dimensions past n_dims.
struct GgufTensorInfo {
  std::string name;
  uint32_t n_dims = 1;
  std::array<int64_t, 4> ne{1, 1, 1, 1};
  GgmlType type = GgmlType::F32;
  uint64_t offset = 0;      // relative to the data section
  uint64_t size_bytes = 0;  // ggml_nbytes, unpadded
};

}  // namespace kvshare::layout
