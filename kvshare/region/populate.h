// Faulting a shared mapping in before it is written, for a provider that keeps the
// decoder's region mapped across requests (kvshare-prefill --serve): every 4 KiB page of a
// fresh mapping takes a page fault on its first write (kvshare/region/chunk_file.h has the
// figures), which a per-request provider pays on every request and a resident one, after
// this, never.
#pragma once

#include <cstddef>
#include <span>
#include <string_view>

#include "layout/error.h"

namespace kvshare {

enum class PopulateMethod {
  madvise_populate_write,  // MADV_POPULATE_WRITE (Linux 5.14)
  touch_read,              // one byte read per page
};
std::string_view populate_method_name(PopulateMethod method);

// Maps in every page of `bytes` (a shared, writable mapping of ours, page-aligned) so that
// later writes take no fault. Changes no byte: the decoder may be writing other cells of
// its region meanwhile. Tries MADV_POPULATE_WRITE; where the kernel does not know it
// (EINVAL) or cannot populate the mapping that way (EFAULT: a dma-buf's PFN mapping, which
// get_user_pages refuses), reads one byte per page instead: a read fault on a shared
// writable mapping without write-notify (shmem, dma-buf) maps the page writable. Either
// way a memfd's holes get their pages now (the decoder's cache is usually cleared, so
// allocated, already). Fails with madvise's errno otherwise (ENOMEM, EHWPOISON), naming
// `what` and the range.
Result<PopulateMethod> populate_for_write(std::span<std::byte> bytes, std::string_view what);

}  // namespace kvshare
