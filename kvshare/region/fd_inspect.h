// What an fd handed over by a peer is, checked before anything maps it.
#pragma once

#include <cstdint>
#include <string>

#include "layout/error.h"

namespace kvshare {

enum class FdKind : uint8_t { memfd, dmabuf };
std::string_view fd_kind_name(FdKind kind);

struct FdInspection {
  FdKind kind = FdKind::memfd;
  uint64_t size_bytes = 0;  // fstat st_size
  int seals = 0;            // F_GET_SEALS (memfd only)
};

// Checks that `fd` (borrowed) is a memfd carrying F_SEAL_SHRINK (so its owner cannot
// truncate it under our mapping) or a dma-buf (/proc/self/fdinfo has exp_name, or the
// link reads "anon_inode:dmabuf" / "/dmabuf:"), at least `need_bytes` long. Anything
// else — a regular file, a pipe, an unsealed memfd, a short buffer — is EINVAL, or
// EBADF for a closed descriptor, with a message naming `what` and the reason.
Result<FdInspection> inspect_fd(int fd, uint64_t need_bytes, const std::string& what);

}  // namespace kvshare
