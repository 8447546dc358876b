#include "support/test_support.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/io_uring.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <thread>

#include "kvshare/statefile/io_queue.h"

namespace kvshare::testing {

std::set<int> open_fds() {
  std::set<int> fds;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return fds;
  const int own = ::dirfd(dir);
  while (dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    const int fd = std::atoi(entry->d_name);
    if (fd != own) fds.insert(fd);
  }
  ::closedir(dir);
  return fds;
}

static std::string fd_target(int fd) {
  char link[64];
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  char target[512];
  const ssize_t n = ::readlink(link, target, sizeof target - 1);
  if (n < 0) return "?";
  target[n] = '\0';
  return target;
}

void FdLeakCheck::SetUp() { before_ = open_fds(); }

void FdLeakCheck::TearDown() {
  for (int fd : open_fds()) {
    if (!before_.count(fd)) ADD_FAILURE() << "fd " << fd << " (" << fd_target(fd) << ") leaked by this test";
  }
}

std::string io_uring_unavailable_reason() {
  if (statefile::io_uring_disabled_by_env()) return std::string(statefile::kNoIoUringEnv) + " is set";
  // The raw syscall, not liburing: the question is what the kernel lets this process do.
  io_uring_params params{};
  const long ring_fd = ::syscall(__NR_io_uring_setup, 2, &params);
  if (ring_fd >= 0) {
    ::close(static_cast<int>(ring_fd));
    return "";
  }
  const int error = errno;
  if (error == ENOSYS) return "io_uring_setup fails with ENOSYS: this kernel has no io_uring";
  if (error == EPERM) return "io_uring_setup fails with EPERM: seccomp or kernel.io_uring_disabled refuses it";
  return "";
}

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string pattern = std::string(base && *base ? base : "/tmp") + "/kvshare-test-XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp " + pattern);
  path_ = pattern;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::filesystem::path tool_path(const std::string& name) { return std::filesystem::path(KVSHARE_BIN_DIR) / name; }
std::filesystem::path data_path(const std::string& name) { return std::filesystem::path(KVSHARE_TEST_DATA_DIR) / name; }

std::vector<std::byte> read_file_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path.string());
  std::vector<char> chars((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> bytes(chars.size());
  std::memcpy(bytes.data(), chars.data(), chars.size());
  return bytes;
}

void write_file_bytes(const std::filesystem::path& path, const std::vector<std::byte>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

CommandResult run_command(const std::string& command_line) {
  TempDir dir;
  const auto out_path = dir / "stdout";
  const auto err_path = dir / "stderr";
  const std::string full = command_line + " >" + out_path.string() + " 2>" + err_path.string() + " </dev/null";
  const int status = std::system(full.c_str());
  CommandResult result;
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  auto slurp = [](const std::filesystem::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  result.out = slurp(out_path);
  result.err = slurp(err_path);
  return result;
}

bool wait_until(const std::function<bool()>& condition, std::chrono::milliseconds deadline) {
  const auto end = std::chrono::steady_clock::now() + deadline;
  for (;;) {
    if (condition()) return true;
    if (std::chrono::steady_clock::now() >= end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

std::string sleep_past_deadline() { return "sleep " + std::to_string(2 * kLoadedDeadline.count()); }

}  // namespace kvshare::testing
