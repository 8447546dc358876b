#include "kvshare/mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>

#include "kvshare/fd.h"
#include "kvshare/sys.h"

namespace kvshare {

Result<Mapping> Mapping::map(int fd, uint64_t offset, uint64_t size_bytes, bool writable, const std::string& what) {
  if (size_bytes == 0) return fail(EINVAL, "mmap of {}: zero length", what);
  const int prot = PROT_READ | (writable ? PROT_WRITE : 0);
  void* data = sys::ops().mmap(nullptr, size_bytes, prot, MAP_SHARED, fd, static_cast<off_t>(offset));
  if (data == MAP_FAILED) return fail(errno, "mmap of {} ({} bytes at offset {})", what, size_bytes, offset);
  return Mapping(data, size_bytes);
}

Result<Mapping> Mapping::map_file_readonly(const std::string& path) {
  Fd fd(sys::ops().open(path.c_str(), O_RDONLY | O_CLOEXEC, 0));
  if (!fd) return fail(errno, "open {}", path);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return fail(errno, "fstat {}", path);
  if (!S_ISREG(st.st_mode)) return fail(EINVAL, "{} is not a regular file", path);
  if (st.st_size == 0) return Mapping();
  void* data = sys::ops().mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (data == MAP_FAILED) return fail(errno, "mmap of {} ({} bytes)", path, st.st_size);
  return Mapping(data, static_cast<size_t>(st.st_size));
}

void Mapping::reset() noexcept {
  if (data_ != nullptr && size_ > 0) sys::ops().munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace kvshare
