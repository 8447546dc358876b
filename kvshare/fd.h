// kvshare::Fd owns one file descriptor.
#pragma once

#include <utility>

namespace kvshare {

// Move-only owner of a descriptor; empty is -1. `get()` borrows, `release()` gives it up,
// the destructor closes. close() is never retried on EINTR: on Linux the descriptor is
// gone either way, and a retry could close a descriptor another thread just opened.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  ~Fd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  explicit operator bool() const { return valid(); }
  int release() { return std::exchange(fd_, -1); }
  // Closes the current descriptor (if any) and takes `fd`.
  void reset(int fd = -1) noexcept;

 private:
  int fd_ = -1;
};

}  // namespace kvshare
