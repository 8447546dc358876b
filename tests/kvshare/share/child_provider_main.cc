// The child provider of the two-process share test: started by ShareBroker with
// --layout FILE --fds 3,4 --tokens N [--type-k NAME], it checks it inherited exactly the
// descriptors it was told about, opens the share against its own header (same model;
// --type-k lets a test make it differ), writes pattern_byte into rows 0..N-1 of every
// cache_k_l<L>/cache_v_l<L>, and prints one summary line.
#include <dirent.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>

#include "kvshare/share/provider_share.h"
#include "share_fixtures.h"

namespace {

int fail_with(int code, const std::string& message) {
  std::fprintf(stderr, "child provider: %s\n", message.c_str());
  return code;
}

std::set<int> open_fds() {
  std::set<int> fds;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return fds;
  while (dirent* entry = ::readdir(dir))
    if (entry->d_name[0] != '.' && std::atoi(entry->d_name) != ::dirfd(dir)) fds.insert(std::atoi(entry->d_name));
  ::closedir(dir);
  return fds;
}

}  // namespace

int main(int argc, char** argv) {
  std::string layout_path, fd_text, type_k = "f16";
  uint64_t n_tokens = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--layout")
      layout_path = argv[i + 1];
    else if (flag == "--fds")
      fd_text = argv[i + 1];
    else if (flag == "--tokens")
      n_tokens = std::strtoull(argv[i + 1], nullptr, 10);
    else if (flag == "--type-k")
      type_k = argv[i + 1];
    else
      return fail_with(2, "unknown flag " + flag);
  }
  auto fds = kvshare::parse_fd_list(fd_text);
  if (!fds) return fail_with(2, fds.error().what());

  std::set<int> expected{0, 1, 2};
  expected.insert(fds->begin(), fds->end());
  const std::set<int> inherited = open_fds();
  if (inherited != expected) {
    std::string extra;
    for (int fd : inherited)
      if (!expected.count(fd)) extra += " " + std::to_string(fd);
    std::string missing;
    for (int fd : expected)
      if (!inherited.count(fd)) missing += " " + std::to_string(fd);
    return fail_with(3, "inherited descriptors differ from --fds: extra [" + extra + " ], missing [" + missing + " ]");
  }

  auto type = kvshare::layout::parse_cache_type(type_k);
  if (!type) return fail_with(2, type.error().what());
  const auto ours = kvshare::testing::small_share_header(256, *type);
  auto share = kvshare::ProviderShare::open(layout_path, *fds, ours);
  if (!share) return fail_with(1, share.error().what());
  auto guards = share->begin_write();
  if (!guards) return fail_with(1, guards.error().what());

  uint64_t written = 0, n_tensors = 0;
  for (uint32_t il = 0;; ++il) {
    auto layer = share->layer(0, il);
    if (!layer) break;
    for (bool is_v : {false, true}) {
      if (is_v && !layer->has_v) continue;
      const auto& view = is_v ? layer->v : layer->k;
      if (n_tokens > view.rows) return fail_with(1, "more tokens than cells");
      for (uint64_t row = 0; row < n_tokens; ++row) {
        auto bytes = view.row(row);
        for (uint64_t column = 0; column < bytes.size(); ++column)
          bytes[column] = static_cast<std::byte>(kvshare::testing::pattern_byte(il, is_v, row, column));
        written += bytes.size();
      }
      ++n_tensors;
    }
  }
  std::printf("child provider: wrote %llu bytes into %llu tensors\n", static_cast<unsigned long long>(written),
              static_cast<unsigned long long>(n_tensors));
  return 0;
}
