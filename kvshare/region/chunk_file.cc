#include "kvshare/region/chunk_file.h"

#include <cerrno>

#include "kvshare/sys.h"

namespace kvshare {

Result<void> write_chunk_file(const ChunkFile& file, uint64_t offset_in_chunk, std::span<const std::byte> bytes) {
  if (!file.writable()) return fail(EBADF, "chunk {}: no descriptor to write through", file.chunk);
  uint64_t done = 0;
  while (done < bytes.size()) {
    const uint64_t at = file.offset + offset_in_chunk + done;
    const ssize_t n = sys::ops().pwrite(file.fd, bytes.data() + done, bytes.size() - done, static_cast<off_t>(at));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail(errno, "pwrite to chunk {} (fd {}) at byte {} of {}", file.chunk, file.fd, at, bytes.size());
    if (n == 0)
      return fail(EIO, "pwrite to chunk {} (fd {}) wrote nothing at byte {} ({} of {} bytes done)", file.chunk, file.fd,
                  at, done, bytes.size());
    done += static_cast<uint64_t>(n);
  }
  return {};
}

}  // namespace kvshare
