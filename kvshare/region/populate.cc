#include "kvshare/region/populate.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

#include "kvshare/sys.h"

// Older headers than the running kernel: the value is the UAPI's
// (include/uapi/asm-generic/mman-common.h); a kernel without it answers EINVAL.
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace kvshare {

std::string_view populate_method_name(PopulateMethod method) {
  return method == PopulateMethod::madvise_populate_write ? "MADV_POPULATE_WRITE" : "one read per page";
}

Result<PopulateMethod> populate_for_write(std::span<std::byte> bytes, std::string_view what) {
  if (bytes.empty()) return PopulateMethod::madvise_populate_write;
  int result;
  do result = sys::ops().madvise(bytes.data(), bytes.size(), MADV_POPULATE_WRITE);
  while (result != 0 && errno == EINTR);
  if (result == 0) return PopulateMethod::madvise_populate_write;
  if (errno != EINVAL && errno != EFAULT)
    return fail(errno, "{}: faulting in {} bytes at {} for writing (MADV_POPULATE_WRITE)", what, bytes.size(),
                static_cast<const void*>(bytes.data()));
  // A read, not a write of the byte read: the decoder may write that byte meanwhile, and
  // writing back the old value would undo its write.
  const long page = ::sysconf(_SC_PAGESIZE);
  const size_t step = page > 0 ? static_cast<size_t>(page) : 4096;
  const volatile std::byte* p = bytes.data();
  std::byte sink{0};
  for (size_t at = 0; at < bytes.size(); at += step) sink |= p[at];
  static_cast<void>(sink);
  return PopulateMethod::touch_read;
}

}  // namespace kvshare
