#include "kvshare/statefile/io_queue.h"

#include <fcntl.h>
#include <liburing.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "kvshare/sys.h"

namespace kvshare::statefile {

bool io_uring_disabled_by_env() {
  const char* value = std::getenv(kNoIoUringEnv);
  return value != nullptr && value[0] != '\0' && std::strcmp(value, "0") != 0;
}

void AlignedBuffer::Free::operator()(std::byte* p) const { std::free(p); }

Result<AlignedBuffer> AlignedBuffer::allocate(size_t size_bytes) {
  // Large buffers take 2 MiB alignment and transparent huge pages: first-touch page faults
  // dominate filling a fresh multi-megabyte buffer on some hosts (the CI VM's cost per 4 KiB
  // fault: docs/protocol.md, "What the route adds, equal work"), and huge pages cut them
  // 512-fold.
  const bool is_large = size_bytes >= kHugePageBytes;
  const size_t alignment = is_large ? kHugePageBytes : kIoAlign;
  const size_t rounded = (std::max<size_t>(size_bytes, 1) + alignment - 1) / alignment * alignment;
  void* memory = std::aligned_alloc(alignment, rounded);
  if (memory == nullptr) return fail(ENOMEM, "allocating a {}-byte I/O buffer", rounded);
  if (is_large) (void)::madvise(memory, rounded, MADV_HUGEPAGE);  // advice only: fine if refused
  AlignedBuffer buffer;
  buffer.data_.reset(static_cast<std::byte*>(memory));
  buffer.size_ = size_bytes;
  buffer.capacity_ = rounded;
  return buffer;
}

struct IoQueue::Ring {
  io_uring ring{};
  bool is_live = false;
  ~Ring() {
    if (is_live) io_uring_queue_exit(&ring);
  }
};

IoQueue::IoQueue(int fd, std::string name, bool is_direct, unsigned depth)
    : fd_(fd), name_(std::move(name)), is_direct_(is_direct), depth_(std::max(1u, depth)) {}

IoQueue::~IoQueue() {
  // The kernel may still be writing into caller buffers: wait for it before they go away.
  // Errors cannot be reported from a destructor; callers that care call drain() first.
  while (ring_ && in_flight_ > 0)
    if (!reap_one()) break;
}

Result<std::unique_ptr<IoQueue>> IoQueue::create(int fd, std::string name, bool is_direct, unsigned depth,
                                                 bool allow_io_uring) {
  std::unique_ptr<IoQueue> queue(new IoQueue(fd, std::move(name), is_direct, depth));
  if (allow_io_uring && !io_uring_disabled_by_env()) {
    auto ring = std::make_unique<Ring>();
    // liburing returns -errno and does not promise errno: convert here. A refusal (seccomp
    // EPERM, ENOSYS, ENOMEM for locked memory) is not an error: we take pwrite instead.
    const int rc = io_uring_queue_init(queue->depth_ * 2, &ring->ring, 0);
    if (rc == 0) {
      ring->is_live = true;
      queue->ring_ = std::move(ring);
    }
  }
  return queue;
}

Result<AlignedBuffer> AlignedBufferPool::take(size_t size_bytes) {
  {
    std::lock_guard lock(mutex_);
    size_t best = kept_.size();
    for (size_t i = 0; i < kept_.size(); ++i)
      if (kept_[i].capacity() >= size_bytes && (best == kept_.size() || kept_[i].capacity() < kept_[best].capacity()))
        best = i;
    if (best < kept_.size()) {
      AlignedBuffer buffer = std::move(kept_[best]);
      kept_.erase(kept_.begin() + static_cast<std::ptrdiff_t>(best));
      buffer.reuse_for(size_bytes);
      return buffer;
    }
  }
  return AlignedBuffer::allocate(size_bytes);
}

void AlignedBufferPool::give(AlignedBuffer buffer) {
  if (buffer.data() == nullptr || buffer.capacity() > max_buffer_bytes_) return;
  std::lock_guard lock(mutex_);
  if (max_kept_ == 0) return;
  if (kept_.size() == max_kept_) kept_.erase(kept_.begin());  // the most recent ones stay
  kept_.push_back(std::move(buffer));
}

bool IoQueue::uses_io_uring() const { return ring_ != nullptr; }

Result<void> IoQueue::turn_off_direct(const IoRequest& request, int error) {
  if (!is_direct_ || error != EINVAL)
    return fail(error, "{} of {} bytes at offset {} of {} (reached offset {})", request.is_write ? "write" : "read",
                request.length, request.offset, name_, request.offset + request.done);
  // Some filesystems accept O_DIRECT at open and refuse it per transfer (or need a larger
  // alignment than ours): go buffered on this fd and retry.
  const int flags = sys::ops().fcntl_int(fd_, F_GETFL, 0);
  if (flags < 0 || sys::ops().fcntl_int(fd_, F_SETFL, flags & ~O_DIRECT) < 0)
    return fail(errno, "turning O_DIRECT off on {} after EINVAL", name_);
  is_direct_ = false;
  stats_.fell_back_to_buffered = true;
  return {};
}

Result<void> IoQueue::transfer_sync(IoRequest& request) {
  const uint64_t want = request.min_bytes ? request.min_bytes : request.length;
  while (request.done < want) {
    const uint64_t left = request.length - request.done;
    std::byte* data = request.data + request.done;
    const auto offset = static_cast<off_t>(request.offset + request.done);
    const ssize_t n =
        request.is_write ? sys::ops().pwrite(fd_, data, left, offset) : sys::ops().pread(fd_, data, left, offset);
    if (n < 0) {
      const int error = errno;
      if (error == EINTR) {
        ++stats_.eintr_retries;
        continue;
      }
      if (auto off = turn_off_direct(request, error); !off) return off;
      continue;
    }
    if (n == 0)
      return fail(request.is_write ? ENOSPC : EIO, "{} of {} bytes at offset {} of {} stopped at offset {} ({})",
                  request.is_write ? "write" : "read", request.length, request.offset, name_,
                  request.offset + request.done, request.is_write ? "0 bytes written" : "end of file");
    if (request.done + static_cast<uint64_t>(n) < want) ++stats_.resumed_short_transfers;
    request.done += static_cast<uint64_t>(n);
  }
  return {};
}

Result<void> IoQueue::push_sqe(IoRequest* request) {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_->ring);
  if (sqe == nullptr) {
    // The ring is twice the depth, so this only happens if completions were not reaped.
    if (int rc = io_uring_submit(&ring_->ring); rc < 0) return fail(-rc, "io_uring_submit for {}", name_);
    sqe = io_uring_get_sqe(&ring_->ring);
    if (sqe == nullptr) return fail(EBUSY, "io_uring submission queue full for {}", name_);
  }
  std::byte* data = request->data + request->done;
  const uint64_t left = request->length - request->done;
  if (request->is_write)
    io_uring_prep_write(sqe, fd_, data, static_cast<unsigned>(left), request->offset + request->done);
  else
    io_uring_prep_read(sqe, fd_, data, static_cast<unsigned>(left), request->offset + request->done);
  io_uring_sqe_set_data(sqe, request);
  for (;;) {
    const int rc = io_uring_submit(&ring_->ring);
    if (rc >= 0) break;
    if (rc == -EINTR) {
      ++stats_.eintr_retries;
      continue;
    }
    return fail(-rc, "io_uring_submit for {} at offset {}", name_, request->offset + request->done);
  }
  return {};
}

Result<void> IoQueue::reap_one() {
  io_uring_cqe* cqe = nullptr;
  for (;;) {
    const int rc = io_uring_wait_cqe(&ring_->ring, &cqe);
    if (rc == 0) break;
    if (rc == -EINTR) {
      ++stats_.eintr_retries;
      continue;
    }
    return fail(-rc, "io_uring_wait_cqe for {}", name_);
  }
  auto* request = static_cast<IoRequest*>(io_uring_cqe_get_data(cqe));
  const int res = cqe->res;
  io_uring_cqe_seen(&ring_->ring, cqe);
  --in_flight_;
  auto it = std::find_if(pending_.begin(), pending_.end(), [&](const auto& p) { return p.get() == request; });
  if (it == pending_.end()) return fail(EIO, "io_uring completion for {} names no request of ours", name_);
  std::unique_ptr<IoRequest> owned = std::move(*it);
  pending_.erase(it);

  auto resubmit = [&]() -> Result<void> {
    IoRequest* raw = owned.get();
    pending_.push_back(std::move(owned));
    ++in_flight_;
    return push_sqe(raw);
  };
  if (res < 0) {
    if (res == -EINTR || res == -EAGAIN) {
      ++stats_.eintr_retries;
      return resubmit();
    }
    if (auto off = turn_off_direct(*owned, -res); !off) return off;
    return resubmit();
  }
  const uint64_t want = owned->min_bytes ? owned->min_bytes : owned->length;
  if (res == 0 && owned->done < want)
    return fail(owned->is_write ? ENOSPC : EIO, "{} of {} bytes at offset {} of {} stopped at offset {} ({})",
                owned->is_write ? "write" : "read", owned->length, owned->offset, name_, owned->offset + owned->done,
                owned->is_write ? "0 bytes written" : "end of file");
  owned->done += static_cast<uint64_t>(res);
  if (owned->done < want) {
    ++stats_.resumed_short_transfers;
    return resubmit();
  }
  completed_.push_back(*owned);
  return {};
}

Result<void> IoQueue::submit(const IoRequest& request) {
  ++stats_.requests;
  if (!ring_) {
    IoRequest copy = request;
    copy.done = 0;
    if (auto rc = transfer_sync(copy); !rc) return rc;
    completed_.push_back(copy);
    return {};
  }
  while (in_flight_ >= depth_)
    if (auto rc = reap_one(); !rc) return rc;
  auto owned = std::make_unique<IoRequest>(request);
  owned->done = 0;
  IoRequest* raw = owned.get();
  pending_.push_back(std::move(owned));
  ++in_flight_;
  return push_sqe(raw);
}

Result<IoRequest> IoQueue::wait() {
  while (completed_.empty()) {
    if (!ring_ || in_flight_ == 0) return fail(EINVAL, "wait on the I/O queue of {}: nothing in flight", name_);
    if (auto rc = reap_one(); !rc) return fail(rc.error());
  }
  IoRequest done = completed_.front();
  completed_.pop_front();
  return done;
}

Result<size_t> IoQueue::drain() {
  size_t count = 0;
  while (in_flight() > 0) {
    auto done = wait();
    if (!done) return fail(done.error());
    ++count;
  }
  return count;
}

}  // namespace kvshare::statefile
