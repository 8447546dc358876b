// One run of the prefill provider (a process per request, or one request to a resident
// provider), as the handoff needs it: how it ended, its wall time,
// what it printed, and the prefill_ms it reported on its last stdout line. The process
// itself is started and waited for by kvshare/share/spawn.h (the file route here, the
// shared route through ShareBroker::run_provider).
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kvshare/share/spawn.h"
#include "layout/error.h"

namespace kvshare::route {

struct ProviderRun {
  bool started = false;    // false: it could not be started (start_error says why); nothing ran
  bool timed_out = false;  // killed (with its group) at the timeout
  ExitStatus status;
  std::string out;  // its stdout
  std::string err;  // its stderr
  double wall_ms = 0;
  std::optional<double> reported_prefill_ms;  // its last stdout line {"prefill_ms": X}
  Error start_error;
  // A resident provider (resident_provider.h) that answered with an error, or was lost
  // during the request: the sentence that says so. Empty for a per-request run.
  std::string failure;
  // A resident provider was sent the decoder's region for this request (a new share
  // generation, a restarted provider, or its ESTALE), taking region_ms of the wall time.
  bool region_sent = false;
  double region_ms = 0;

  bool ok() const { return started && !timed_out && status.ok() && failure.empty(); }
  // The log line's X: the provider's own figure when it gave one, else the wall time.
  double prefill_ms() const { return reported_prefill_ms.value_or(wall_ms); }
  // "exit code 3", "signal 9 (Killed)", "timed out after 2000 ms (killed with its process
  // group)", "could not start: ..."
  std::string describe() const;
};

// What a spawn-and-wait (run_child, ShareBroker::run_provider) returned, as a ProviderRun.
ProviderRun provider_run_from(Result<Finished> finished);

// Runs `argv` with `inherit_fds` ((our fd, its number) pairs) and `env` ("NAME=VALUE" set on
// top of serve's environment), stdout and stderr captured, and waits at most `timeout` (then
// kills its group).
ProviderRun run_provider(const std::vector<std::string>& argv, const std::vector<std::pair<int, int>>& inherit_fds,
                         std::chrono::milliseconds timeout, std::vector<std::string> env = {});

// The last non-empty line of `out` when it is a JSON object with a numeric "prefill_ms".
std::optional<double> reported_prefill_ms(const std::string& out);

}  // namespace kvshare::route
