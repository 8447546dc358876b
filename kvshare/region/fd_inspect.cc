#include "kvshare/region/fd_inspect.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <string>

#include "kvshare/sys.h"

namespace kvshare {
namespace {

std::string fd_link(int fd) {
  char link[64];
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  char target[256];
  const ssize_t n = ::readlink(link, target, sizeof target - 1);
  if (n < 0) return {};
  return std::string(target, static_cast<size_t>(n));
}

// Every dma-buf's fdinfo has "exp_name:" (drivers/dma-buf/dma-buf.c, dma_buf_show_fdinfo).
bool fdinfo_has_exp_name(int fd) {
  std::ifstream in("/proc/self/fdinfo/" + std::to_string(fd));
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("exp_name:", 0) == 0) return true;
  return false;
}

bool looks_like_dmabuf(int fd) {
  const std::string link = fd_link(fd);
  if (link == "anon_inode:dmabuf" || link.rfind("/dmabuf:", 0) == 0) return true;
  return fdinfo_has_exp_name(fd);
}

}  // namespace

std::string_view fd_kind_name(FdKind kind) { return kind == FdKind::memfd ? "memfd" : "dma-buf"; }

Result<FdInspection> inspect_fd(int fd, uint64_t need_bytes, const std::string& what) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return fail(errno, "fstat {}", what);
  FdInspection inspection;
  inspection.size_bytes = st.st_size > 0 ? static_cast<uint64_t>(st.st_size) : 0;

  const int seals = sys::ops().fcntl_int(fd, F_GET_SEALS, 0);
  if (seals >= 0 && S_ISREG(st.st_mode)) {
    inspection.kind = FdKind::memfd;
    inspection.seals = seals;
    if ((seals & F_SEAL_SHRINK) == 0)
      return fail(EINVAL,
                  "{}: memfd is not sealed against shrinking (seals {:#x}); its owner could truncate it "
                  "under our mapping",
                  what, seals);
  } else if (looks_like_dmabuf(fd)) {
    inspection.kind = FdKind::dmabuf;
    if (inspection.size_bytes == 0) {
      // A dma-buf reports its size through llseek(SEEK_END) (dma_buf_llseek).
      const off_t end = ::lseek(fd, 0, SEEK_END);
      if (end > 0) inspection.size_bytes = static_cast<uint64_t>(end);
      ::lseek(fd, 0, SEEK_SET);
    }
  } else {
    const std::string link = fd_link(fd);
    return fail(EINVAL, "{}: is neither a sealed memfd nor a dma-buf (it is \"{}\")", what,
                link.empty() ? "unknown" : link);
  }
  if (inspection.size_bytes < need_bytes)
    return fail(EINVAL, "{}: {} is {} bytes, the layout needs {}", what, fd_kind_name(inspection.kind),
                inspection.size_bytes, need_bytes);
  return inspection;
}

}  // namespace kvshare
