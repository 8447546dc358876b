// One run of the prefill provider: start it in its own process group, wait at most the
// provider timeout (then kill the group), and keep what the log line needs: how it ended,
// its wall time and the prefill_ms it reported on its last stdout line.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kvshare/route/child_process.h"
#include "layout/error.h"

namespace kvshare::route {

struct ProviderRun {
  bool started = false;     // false: exec failed (start_error says why); nothing ran
  bool timed_out = false;   // killed (with its group) at the timeout
  ExitStatus status;
  std::string out;          // its stdout
  double wall_ms = 0;
  std::optional<double> reported_prefill_ms;  // its last stdout line {"prefill_ms": X}
  Error start_error;

  bool ok() const { return started && !timed_out && status.ok(); }
  // The log line's X: the provider's own figure when it gave one, else the wall time.
  double prefill_ms() const { return reported_prefill_ms.value_or(wall_ms); }
  // "exit code 3", "timed out after 2000 ms (killed with its process group)", "could not start: ..."
  std::string describe() const;
};

// Runs `argv` with `inherit_fds` ((our fd, its number) pairs) and `env` ("NAME=VALUE" set on
// top of serve's environment) and waits at most `timeout`.
ProviderRun run_provider(const std::vector<std::string>& argv, const std::vector<std::pair<int, int>>& inherit_fds,
                         std::chrono::milliseconds timeout, std::vector<std::string> env = {});

}  // namespace kvshare::route
