// Starting a provider with exactly the descriptors it is told about, and waiting for it.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "layout/error.h"

namespace kvshare {

struct ChildResult {
  int exit_code = -1;          // exit status, or 128 + signal
  bool timed_out = false;      // killed (with its process group) at the deadline
  double elapsed_ms = 0;
  std::string stdout_text;     // the last 64 KiB
  std::string stderr_text;     // the last 64 KiB
  // The last non-empty line of stdout: where a provider puts its one-line summary.
  std::string last_stdout_line() const;
};

// Runs argv[0] (a path, or a name looked up in PATH) with argv, stdin /dev/null, stdout
// and stderr captured, and `inherit` (borrowed) duplicated to descriptors 3, 4, ... in
// order; every other descriptor of this process is closed at exec whatever its flags.
// The child leads its own process group. Waits at most `timeout_ms`, then kills the group
// and reports timed_out. Fails (ENOENT, EACCES, ...) when the program cannot be started.
Result<ChildResult> run_child(const std::vector<std::string>& argv, std::span<const int> inherit, int timeout_ms);

// "3,4" for n inherited descriptors starting at 3.
std::string inherited_fd_list(size_t n_fds);

}  // namespace kvshare
