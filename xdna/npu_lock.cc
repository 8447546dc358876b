#include "xdna/npu_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include "kvshare/sys.h"

namespace kvshare::xdna {
namespace {

// "/proc/<pid>/cmdline" with NULs as spaces, or "" when the process is gone or hidden.
std::string command_line_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/cmdline", std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (char& c : text)
    if (c == '\0') c = ' ';
  while (!text.empty() && text.back() == ' ') text.pop_back();
  return text;
}

std::string describe_holder(const std::string& path) {
  const pid_t pid = npu_lock_holder(path);
  if (pid <= 0) return "a process that did not write its pid";
  const std::string command = command_line_of(pid);
  return command.empty() ? fmt::format("pid {}", pid) : fmt::format("pid {} ({})", pid, command);
}

}  // namespace

std::string default_npu_lock_path() {
  const char* override_path = std::getenv("KVSHARE_NPU_LOCK");
  return override_path != nullptr && *override_path != '\0' ? override_path : kNpuLockPath;
}

pid_t npu_lock_holder(const std::string& path) {
  std::ifstream in(path);
  long pid = 0;
  if (!(in >> pid) || pid <= 0) return 0;
  return static_cast<pid_t>(pid);
}

Result<NpuLock> acquire_npu_lock(const std::string& path, int timeout_ms) {
  Fd fd(sys::ops().open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666));
  if (!fd) return fail(errno, "NPU lock {}: cannot open", path);
  // Every user of the NPU must be able to open the same file, and open's mode passes
  // through the umask (0022 makes it 0644): whoever owns the file sets 0666 explicitly.
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return fail(errno, "NPU lock {}: fstat", path);
  if (st.st_uid == ::geteuid() && (st.st_mode & 0777) != 0666 && ::fchmod(fd.get(), 0666) != 0)
    return fail(errno, "NPU lock {}: fchmod 0666 (it is {:o}; other users could not take the lock)", path,
                st.st_mode & 0777);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max(0, timeout_ms));
  while (sys::ops().flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno == EINTR) continue;
    if (errno != EWOULDBLOCK) return fail(errno, "NPU lock {}: flock", path);
    if (std::chrono::steady_clock::now() >= deadline)
      return fail(ETIMEDOUT, "NPU lock {}: held by {} for longer than the {} ms wait", path, describe_holder(path),
                  timeout_ms);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Ours now: record the pid for the next waiter's message.
  const std::string pid_line = std::to_string(getpid()) + "\n";
  if (sys::ops().ftruncate(fd.get(), 0) != 0 ||
      sys::ops().pwrite(fd.get(), pid_line.data(), pid_line.size(), 0) != static_cast<ssize_t>(pid_line.size()))
    return fail(errno, "NPU lock {}: writing our pid into the lock file", path);
  return NpuLock(std::move(fd), path);
}

NpuLock& NpuLock::operator=(NpuLock&& other) noexcept {
  if (this != &other) {
    release();
    fd_ = std::move(other.fd_);
    path_ = std::move(other.path_);
  }
  return *this;
}

NpuLock::~NpuLock() { release(); }

void NpuLock::release() noexcept {
  if (!fd_) return;
  // Clear the pid while still holding the lock, so nobody is blamed after we leave.
  (void)sys::ops().ftruncate(fd_.get(), 0);
  fd_.reset();
}

}  // namespace kvshare::xdna
