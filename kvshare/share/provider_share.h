// The provider side of share/adopt (what the NPU engine and kvshare-prefill link): read
// the layout header the broker wrote (--layout FILE), check it against this provider's
// own model and KV params, import the inherited fds (--fds 3,4) with this process's own
// mappings, and hand out the per-layer K/V destinations to scatter a prefill into.
//
// Lifetime: the provider writes cells 0..n-1 of the decoder's cache between the share and
// the adopt, and must have finished (exited, or dropped its CPU-access guards) before the
// broker reports it done; the decoder never re-checks the bytes (llama_kv_cells_adopt).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvshare/fd.h"
#include "kvshare/region/importer.h"
#include "layout/error.h"
#include "layout/share_header.h"

namespace kvshare {

// Parses "--fds" ("3,4"): descriptor numbers >= 3, no duplicates, at most 253. EINVAL
// naming the bad element.
Result<std::vector<int>> parse_fd_list(std::string_view text);
// Parses "--fd-offsets" ("0,4096"), "" = none.
Result<std::vector<uint64_t>> parse_offset_list(std::string_view text);

// Reads and parses the layout header file (at most 16 MiB). Errors name the path.
Result<layout::ShareHeader> read_header_file(const std::string& path);

struct ReceivedShare;  // kvshare/share/broker.h

class ProviderShare {
 public:
  // Reads `layout_path`, refuses a header that differs from `ours` in anything that
  // changes the bytes (layout::check_compatible: the error names the field), takes
  // ownership of the descriptors `fd_numbers` (marking them close-on-exec so nothing this
  // provider starts inherits them) and imports them writable. EBADF names a number that
  // is not an open descriptor.
  static Result<ProviderShare> open(const std::string& layout_path, std::span<const int> fd_numbers,
                                    const layout::ShareHeader& ours, std::span<const uint64_t> fd_offsets = {});
  // The same without the compatibility check, for tools that only inspect a share.
  static Result<ProviderShare> open_unchecked(const std::string& layout_path, std::span<const int> fd_numbers,
                                              std::span<const uint64_t> fd_offsets = {});
  // A resident provider's form of open: the share serve forwarded on its channel
  // (kvshare/share/provider_channel.h), its header already parsed and its fds already
  // checked against the layout. Refuses it as open does when `ours` is given (nullptr:
  // unchecked), takes its fds (closed on any failure) and imports them writable, each at
  // its entry's offset. Errors name `source`.
  static Result<ProviderShare> open_received(ReceivedShare&& share, const layout::ShareHeader* ours,
                                             std::string_view source);

  const layout::ShareHeader& header() const { return header_; }
  const ImportedShare& imported() const { return imported_; }
  Result<TensorView> view(std::string_view name) const { return imported_.view(name); }
  // Where layer `il` of cache object `cache_index` puts a token's K row and V row.
  Result<LayerDestination> layer(uint32_t cache_index, uint32_t il) const { return imported_.layer(cache_index, il); }
  // Brackets the CPU writes into dma-buf regions; hold the guards while writing.
  Result<std::vector<DmaBufCpuAccess>> begin_write() const {
    return imported_.begin_cpu_access(DmaBufCpuAccess::Mode::write);
  }

 private:
  ProviderShare(layout::ShareHeader header, ImportedShare imported)
      : header_(std::move(header)), imported_(std::move(imported)) {}
  static Result<ProviderShare> open_impl(const std::string& layout_path, std::span<const int> fd_numbers,
                                         const layout::ShareHeader* ours, std::span<const uint64_t> fd_offsets);
  // What both forms share once the header and the fds are in hand.
  static Result<ProviderShare> import(layout::ShareHeader header, std::vector<Fd> fds,
                                      std::span<const uint64_t> fd_offsets, const layout::ShareHeader* ours,
                                      std::string_view source);
  layout::ShareHeader header_;
  ImportedShare imported_;
};

}  // namespace kvshare
