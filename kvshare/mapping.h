// kvshare::Mapping owns one mmap'ed range.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>

#include "layout/error.h"

namespace kvshare {

// Owns an address and a length; unmaps on destruction. Made from a borrowed fd and a
// length that layout/ computed (never from the fd's current size alone).
class Mapping {
 public:
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  Mapping(Mapping&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  Mapping& operator=(Mapping&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  ~Mapping() { reset(); }

  // Maps `size_bytes` of `fd` (borrowed) from `offset` (page-aligned), shared, read-write
  // when `writable`. `what` names the object in errors ("dma-buf fd 7 (chunk 2)").
  static Result<Mapping> map(int fd, uint64_t offset, uint64_t size_bytes, bool writable, const std::string& what);
  // Maps a whole regular file read-only (GGUF models, state files to inspect).
  static Result<Mapping> map_file_readonly(const std::string& path);

  std::span<std::byte> bytes() const { return {static_cast<std::byte*>(data_), size_}; }
  std::byte* data() const { return static_cast<std::byte*>(data_); }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  void reset() noexcept;

 private:
  Mapping(void* data, size_t size) : data_(data), size_(size) {}
  void* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace kvshare
