// Positioned reads and writes of large aligned chunks on one file, on io_uring when the
// kernel lets us, else on plain pread/pwrite (through kvshare/sys.h, so tests can inject
// EINTR, ENOSPC and short transfers). The state-file writer and reader use it; nothing here
// knows the state-file format.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "layout/error.h"

namespace kvshare::statefile {

// O_DIRECT wants the buffer address, the file offset and the length aligned to the logical
// block size: 4096 covers 512-byte and 4 KiB devices alike.
inline constexpr size_t kIoAlign = 4096;

// KVSHARE_NO_IO_URING=1 (set and not "0") forces the pread/pwrite path, for tests and for
// hosts where io_uring is allowed but unwanted.
inline constexpr const char* kNoIoUringEnv = "KVSHARE_NO_IO_URING";
bool io_uring_disabled_by_env();

inline constexpr size_t kHugePageBytes = 2u << 20;

// A heap buffer aligned to kIoAlign (2 MiB and huge-page advised from 2 MiB up), not
// initialised, owned.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // Fails with ENOMEM naming the size.
  static Result<AlignedBuffer> allocate(size_t size_bytes);
  std::byte* data() const { return data_.get(); }
  size_t size() const { return size_; }
  size_t capacity() const { return capacity_; }  // bytes allocated (size rounded up)
  // Takes `size_bytes` as the new size when the allocation holds it; false otherwise.
  bool reuse_for(size_t size_bytes) {
    if (!data_ || size_bytes > capacity_) return false;
    size_ = size_bytes;
    return true;
  }

 private:
  struct Free {
    void operator()(std::byte* p) const;
  };
  std::unique_ptr<std::byte, Free> data_;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

// Buffers kept for reuse, bounded in count and size, shared by threads: faulting in a
// fresh multi-megabyte buffer costs a page fault and a page of zeroes per page before the
// first byte, as much as writing or reading a small state file (kvshare-bench statefile).
class AlignedBufferPool {
 public:
  AlignedBufferPool(size_t max_kept, size_t max_buffer_bytes)
      : max_kept_(max_kept), max_buffer_bytes_(max_buffer_bytes) {}
  // The smallest kept buffer that holds `size_bytes` (resized to it), else a new one.
  Result<AlignedBuffer> take(size_t size_bytes);
  // Keeps `buffer` unless it is over the size limit (then frees it); when the pool is full
  // the buffer kept longest goes.
  void give(AlignedBuffer buffer);

 private:
  const size_t max_kept_;
  const size_t max_buffer_bytes_;
  std::mutex mutex_;
  std::vector<AlignedBuffer> kept_;
};

struct IoRequest {
  std::byte* data = nullptr;  // borrowed; must stay valid until the request completes
  uint64_t length = 0;        // bytes asked for
  uint64_t offset = 0;        // file offset
  bool is_write = true;
  uint64_t tag = 0;  // caller's id, handed back on completion
  // Reads: the request is complete once this many bytes arrived (the file's end may lie
  // inside an aligned O_DIRECT read). 0 means `length`.
  uint64_t min_bytes = 0;
  uint64_t done = 0;  // bytes transferred so far (set by the queue)
};

// Counts a test (or the benchmark) can check.
struct IoStats {
  uint64_t requests = 0;
  uint64_t resumed_short_transfers = 0;
  uint64_t eintr_retries = 0;
  bool fell_back_to_buffered = false;  // O_DIRECT refused (EINVAL) and turned off on the fd
};

class IoQueue {
 public:
  // Works on `fd` (borrowed, must outlive the queue). `name` is the path for messages.
  // `is_direct` says the fd was opened with O_DIRECT. Uses io_uring with `depth` entries
  // unless `allow_io_uring` is false, KVSHARE_NO_IO_URING is set, or io_uring_queue_init
  // fails (ENOSYS, EPERM under seccomp, ENOMEM): then every call is a blocking pread/pwrite.
  static Result<std::unique_ptr<IoQueue>> create(int fd, std::string name, bool is_direct, unsigned depth,
                                                 bool allow_io_uring);
  ~IoQueue();
  IoQueue(const IoQueue&) = delete;
  IoQueue& operator=(const IoQueue&) = delete;

  // Queues `request`. When `depth` requests are in flight, first waits for one to complete
  // (it is then returned by the next wait()). A short transfer is resumed from the byte
  // reached; a transfer of 0 bytes, or any error, fails the queue with the offset reached.
  // EINVAL on an O_DIRECT fd turns O_DIRECT off (F_SETFL) and retries buffered once.
  Result<void> submit(const IoRequest& request);
  // Blocks until a request completes and returns it (with `done` set). Fails with EINVAL
  // ("nothing in flight") when nothing is queued.
  Result<IoRequest> wait();
  // Waits for every queued request; returns how many completed.
  Result<size_t> drain();

  size_t in_flight() const { return in_flight_ + completed_.size(); }
  bool uses_io_uring() const;
  bool is_direct() const { return is_direct_; }
  const IoStats& stats() const { return stats_; }
  const char* backend_name() const { return uses_io_uring() ? "io_uring" : "pread/pwrite"; }

 private:
  struct Ring;
  IoQueue(int fd, std::string name, bool is_direct, unsigned depth);
  Result<void> transfer_sync(IoRequest& request);
  Result<void> push_sqe(IoRequest* request);
  Result<void> reap_one();
  Result<void> turn_off_direct(const IoRequest& request, int error);

  int fd_;
  std::string name_;
  bool is_direct_;
  unsigned depth_;
  std::unique_ptr<Ring> ring_;
  size_t in_flight_ = 0;
  std::deque<std::unique_ptr<IoRequest>> pending_;  // owned while in the kernel
  std::deque<IoRequest> completed_;
  IoStats stats_;
};

}  // namespace kvshare::statefile
