// Builds GGUF bytes field by field for reader tests, independent of GgufWriter, so a
// malformed file can be spelled out exactly (and a writer bug cannot hide a reader bug).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <vector>

namespace kvshare::layout::testing {

class GgufBytes {
 public:
  template <class T>
  GgufBytes& put(T value) {
    const auto* p = reinterpret_cast<const std::byte*>(&value);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
    return *this;
  }
  GgufBytes& u8(uint8_t v) { return put(v); }
  GgufBytes& u32(uint32_t v) { return put(v); }
  GgufBytes& i32(int32_t v) { return put(v); }
  GgufBytes& u64(uint64_t v) { return put(v); }
  GgufBytes& i64(int64_t v) { return put(v); }
  GgufBytes& str(std::string_view text) {
    u64(text.size());
    const auto* p = reinterpret_cast<const std::byte*>(text.data());
    bytes_.insert(bytes_.end(), p, p + text.size());
    return *this;
  }
  // "GGUF", version, n_tensors, n_kv.
  GgufBytes& header(uint32_t version, int64_t n_tensors, int64_t n_kv) {
    bytes_.insert(bytes_.end(), {std::byte{'G'}, std::byte{'G'}, std::byte{'U'}, std::byte{'F'}});
    return u32(version).i64(n_tensors).i64(n_kv);
  }
  // A u32 key/value pair.
  GgufBytes& kv_u32(std::string_view key, uint32_t value) { return str(key).i32(4).u32(value); }
  // A tensor info: name, n_dims, ne..., type, offset.
  GgufBytes& tensor(std::string_view name, std::vector<int64_t> ne, int32_t type, uint64_t offset) {
    str(name).u32(static_cast<uint32_t>(ne.size()));
    for (int64_t n : ne) i64(n);
    return i32(type).u64(offset);
  }
  GgufBytes& pad_to(size_t alignment) {
    while (bytes_.size() % alignment != 0) bytes_.push_back(std::byte{0});
    return *this;
  }
  GgufBytes& zeros(size_t n) {
    bytes_.insert(bytes_.end(), n, std::byte{0});
    return *this;
  }
  size_t size() const { return bytes_.size(); }
  const std::vector<std::byte>& bytes() const { return bytes_; }
  std::span<const std::byte> span() const { return bytes_; }

 private:
  std::vector<std::byte> bytes_;
};

}  // namespace kvshare::layout::testing
