// Shared test helpers: the fd-leak fixture, temporary directories, paths of tools and data.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <set>
#include <string>
#include <vector>

namespace kvshare::testing {

// Descriptors open in this process now (from /proc/self/fd), excluding the one the
// listing itself uses.
std::set<int> open_fds();

// Fixture for tests that touch descriptors: fails the test if any fd opened during it
// is still open at the end, naming the fd and what it points to.
class FdLeakCheck : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;

 private:
  std::set<int> before_;
};

// Why this process gets no io_uring ring, or "" when io_uring_setup(2) works here: the
// kernel lacks it (ENOSYS), seccomp or kernel.io_uring_disabled refuses it (EPERM), or
// KVSHARE_NO_IO_URING turns it off. A test of the ring skips with this reason; any other
// failure to set one up is no missing capability, so the test runs and fails.
std::string io_uring_unavailable_reason();

// A fresh private directory under $TMPDIR, removed with everything in it on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

// build/bin/<name> (the tools), tests/data/<name> (vectors).
std::filesystem::path tool_path(const std::string& name);
std::filesystem::path data_path(const std::string& name);

// Reads or writes a whole file as bytes (test-side I/O only).
std::vector<std::byte> read_file_bytes(const std::filesystem::path& path);
void write_file_bytes(const std::filesystem::path& path, const std::vector<std::byte>& bytes);

// Runs a command through /bin/sh, capturing stdout and stderr separately.
struct CommandResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};
CommandResult run_command(const std::string& command_line);

// How long a test gives a condition it waits for: a safety net against a hang, never a
// measurement. Generous because CI runs the suite two at a time on 2 busy cores, where a
// step that takes milliseconds idle can take seconds.
inline constexpr std::chrono::seconds kLoadedDeadline{60};

// Checks `condition` every millisecond until it holds or `deadline` has passed; returns
// whether it held. For a state another thread or process reaches with no event to wait
// on: a test waits for what it means, not for a time.
bool wait_until(const std::function<bool()>& condition, std::chrono::milliseconds deadline = kLoadedDeadline);

// A shell command that outlives a wait of kLoadedDeadline ("sleep 120"): a leftover process
// a test waits to see killed must not end by itself within that wait, or a kill that never
// came would pass.
std::string sleep_past_deadline();

}  // namespace kvshare::testing
