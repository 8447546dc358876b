#include "kvshare/share/provider_share.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <cerrno>
#include <charconv>
#include <set>

#include "kvshare/handshake/message.h"
#include "kvshare/share/broker.h"
#include "kvshare/sys.h"

namespace kvshare {
namespace {

constexpr uint64_t kMaxHeaderFileBytes = 16u << 20;

template <class T>
Result<std::vector<T>> parse_list(std::string_view text, std::string_view flag) {
  std::vector<T> values;
  if (text.empty()) return values;
  size_t start = 0;
  for (;;) {
    const size_t comma = text.find(',', start);
    const std::string_view item =
        text.substr(start, comma == std::string_view::npos ? text.size() - start : comma - start);
    T value{};
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), value);
    if (item.empty() || ec != std::errc() || end != item.data() + item.size())
      return fail(EINVAL, "{} \"{}\": \"{}\" is not a number (expected e.g. 3,4)", flag, text, item);
    values.push_back(value);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return values;
}

}  // namespace

Result<std::vector<int>> parse_fd_list(std::string_view text) {
  auto fds = parse_list<int>(text, "--fds");
  if (!fds) return fail(fds.error());
  if (fds->empty()) return fail(EINVAL, "--fds is empty: the broker passes at least one descriptor");
  if (fds->size() > handshake::kMaxFds)
    return fail(EINVAL, "--fds lists {} descriptors, the limit is {}", fds->size(), handshake::kMaxFds);
  std::set<int> seen;
  for (int fd : *fds) {
    if (fd < 3) return fail(EINVAL, "--fds \"{}\": {} is stdin, stdout or stderr, not a shared region", text, fd);
    if (!seen.insert(fd).second) return fail(EINVAL, "--fds \"{}\": {} is listed twice", text, fd);
  }
  return fds;
}

Result<std::vector<uint64_t>> parse_offset_list(std::string_view text) {
  return parse_list<uint64_t>(text, "--fd-offsets");
}

Result<layout::ShareHeader> read_header_file(const std::string& path) {
  Fd fd(sys::ops().open(path.c_str(), O_RDONLY | O_CLOEXEC, 0));
  if (!fd) return fail(errno, "open layout header {}", path);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return fail(errno, "fstat layout header {}", path);
  if (!S_ISREG(st.st_mode)) return fail(EINVAL, "layout header {} is not a regular file", path);
  if (static_cast<uint64_t>(st.st_size) > kMaxHeaderFileBytes)
    return fail(EFBIG, "layout header {} is {} bytes, the limit is {}", path, st.st_size, kMaxHeaderFileBytes);
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = sys::ops().read(fd.get(), text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail(errno, "read layout header {} at byte {}", path, got);
    if (n == 0) return fail(EIO, "layout header {}: short read at byte {} of {}", path, got, text.size());
    got += static_cast<size_t>(n);
  }
  return layout::parse_share_header(text, path);
}

Result<ProviderShare> ProviderShare::open(const std::string& layout_path, std::span<const int> fd_numbers,
                                          const layout::ShareHeader& ours, std::span<const uint64_t> fd_offsets) {
  return open_impl(layout_path, fd_numbers, &ours, fd_offsets);
}

Result<ProviderShare> ProviderShare::open_unchecked(const std::string& layout_path, std::span<const int> fd_numbers,
                                                    std::span<const uint64_t> fd_offsets) {
  return open_impl(layout_path, fd_numbers, nullptr, fd_offsets);
}

Result<ProviderShare> ProviderShare::open_impl(const std::string& layout_path, std::span<const int> fd_numbers,
                                               const layout::ShareHeader* ours, std::span<const uint64_t> fd_offsets) {
  // Own the descriptors first: every failure below closes them.
  std::vector<Fd> fds;
  std::string bad;
  for (int number : fd_numbers) {
    const int flags = sys::ops().fcntl_int(number, F_GETFD, 0);
    if (flags < 0) {
      bad += (bad.empty() ? "" : ",") + std::to_string(number);
      continue;
    }
    sys::ops().fcntl_int(number, F_SETFD, flags | FD_CLOEXEC);
    fds.emplace_back(number);
  }
  if (!bad.empty())
    return fail(EBADF, "--fds: descriptor(s) {} are not open in this process (the broker passes them at 3, 4, ...)",
                bad);
  auto header = read_header_file(layout_path);
  if (!header) return fail(header.error());
  return import(std::move(*header), std::move(fds), fd_offsets, ours, layout_path);
}

Result<ProviderShare> ProviderShare::open_received(ReceivedShare&& share, const layout::ShareHeader* ours,
                                                   std::string_view source) {
  std::vector<uint64_t> offsets;
  offsets.reserve(share.entries.size());
  for (const auto& entry : share.entries) offsets.push_back(entry.offset);
  return import(std::move(share.header), std::move(share.fds), offsets, ours, source);
}

Result<ProviderShare> ProviderShare::import(layout::ShareHeader header, std::vector<Fd> fds,
                                            std::span<const uint64_t> fd_offsets, const layout::ShareHeader* ours,
                                            std::string_view source) {
  if (ours != nullptr) {
    if (auto compatible = layout::check_compatible(*ours, header, source); !compatible) return fail(compatible.error());
  }
  auto imported = ImportedShare::import(header.layout, std::move(fds), fd_offsets, true);
  if (!imported) return fail(imported.error().with_context(fmt::format("share from {}", source)));
  return ProviderShare(std::move(header), std::move(*imported));
}

}  // namespace kvshare
