#include "kvshare/route/provider_run.h"

#include <cerrno>

namespace kvshare::route {

std::string ProviderRun::describe() const {
  if (!started) return "could not start: " + start_error.what();
  if (timed_out) return fmt::format("timed out after {:.0f} ms (killed with its process group)", wall_ms);
  return status.describe();
}

ProviderRun run_provider(const std::vector<std::string>& argv, const std::vector<std::pair<int, int>>& inherit_fds,
                         std::chrono::milliseconds timeout, std::vector<std::string> env) {
  ProviderRun run;
  SpawnOptions options;
  options.inherit_fds = inherit_fds;
  options.env = std::move(env);
  options.capture_stdout = true;
  const auto start = std::chrono::steady_clock::now();
  auto child = ChildProcess::spawn(argv, options);
  if (!child) {
    run.start_error = child.error();
    return run;
  }
  run.started = true;
  auto finished = child->wait_for(timeout);
  run.wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (!finished) {
    run.timed_out = true;
    child->kill_group();
    return run;
  }
  run.status = finished->status;
  run.out = std::move(finished->out);
  run.reported_prefill_ms = reported_prefill_ms(run.out);
  child->kill_group();  // anything the provider left running in its group goes too
  return run;
}

}  // namespace kvshare::route
