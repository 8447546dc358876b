#include "route/state_version_probe.h"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cerrno>

#include "kvshare/fd.h"
#include "layout/state_format.h"

namespace kvshare::route {

Result<uint32_t> read_state_file_version(const std::filesystem::path& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return fail(errno, "opening state file {}", path.string());
  std::array<std::byte, 8> head{};
  size_t got = 0;
  while (got < head.size()) {
    const ssize_t n = ::read(fd.get(), head.data() + got, head.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail(errno, "reading state file {} at offset {}", path.string(), got);
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  return layout::peek_state_version(std::span<const std::byte>(head.data(), got), path.string());
}

Result<uint32_t> probe_decoder_state_version(const DecoderClient& decoder, const std::filesystem::path& slot_dir) {
  // The name is ours alone in serve's private slot directory; removed whatever happens.
  const std::string name = fmt::format("kvshare-state-version-probe-{}.state", ::getpid());
  const std::filesystem::path path = slot_dir / name;
  struct Remove {
    std::filesystem::path path;
    ~Remove() {
      std::error_code ec;
      std::filesystem::remove(path, ec);
    }
  } remove{path};
  auto saved = decoder.slot_action("save", nlohmann::json{{"filename", name}});
  if (!saved) return fail(saved.error().with_context("POST /slots/0?action=save (state-version probe)"));
  if (!saved->ok())
    return fail(EPROTO, "POST /slots/0?action=save (state-version probe) answered {}: {}", saved->status,
                saved->error_message);
  auto version = read_state_file_version(path);
  if (!version) return fail(version.error().with_context("the decoder's probe save"));
  return *version;
}

}  // namespace kvshare::route
