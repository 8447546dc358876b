// The NPU device lock: an NPU run holds an exclusive flock on one well-known file and
// nothing else, so two providers (or a provider and another NPU user following the same
// convention) never submit at once. The holder writes its pid into the file so a waiter
// can say who is in the way.
#pragma once

#include <sys/types.h>
#include <string>

#include "kvshare/fd.h"
#include "layout/error.h"

namespace kvshare::xdna {

// Shared with the other NPU tools on the machine: changing it breaks mutual exclusion.
inline constexpr const char* kNpuLockPath = "/tmp/1bit-npu-device.lock";

// kNpuLockPath, or $KVSHARE_NPU_LOCK when set (tests, or a site that moved the file).
std::string default_npu_lock_path();

// Holds the lock until destroyed (closing the fd releases the flock, even if the process
// dies). Move-only.
class NpuLock {
 public:
  NpuLock() = default;
  NpuLock(Fd fd, std::string path) : fd_(std::move(fd)), path_(std::move(path)) {}
  NpuLock(NpuLock&&) noexcept = default;
  NpuLock& operator=(NpuLock&&) noexcept;
  ~NpuLock();
  bool held() const { return fd_.valid(); }
  const std::string& path() const { return path_; }
  // Releases early (what the destructor does).
  void release() noexcept;

 private:
  Fd fd_;
  std::string path_;
};

// Takes the exclusive lock on `path` (created 0666 if missing), waiting up to
// `timeout_ms` (0: try once). On success the file holds "<pid>\n". Fails with ETIMEDOUT
// naming the holder's pid and command line when it still holds the lock, or with the
// errno of open/flock naming the path.
Result<NpuLock> acquire_npu_lock(const std::string& path, int timeout_ms);

// The pid written into the lock file, 0 when empty or unreadable.
pid_t npu_lock_holder(const std::string& path);

}  // namespace kvshare::xdna
