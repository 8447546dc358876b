#include "route/provider_run.h"

#include <cerrno>
#include <nlohmann/json.hpp>

namespace kvshare::route {

std::string ProviderRun::describe() const {
  if (!started) return "could not start: " + start_error.what();
  if (!failure.empty()) return failure;
  if (timed_out) return fmt::format("timed out after {:.0f} ms (killed with its process group)", wall_ms);
  return status.describe();
}

ProviderRun provider_run_from(Result<Finished> finished) {
  ProviderRun run;
  if (!finished) {
    run.start_error = finished.error();
    return run;
  }
  run.started = true;
  run.timed_out = finished->timed_out;
  run.status = finished->status;
  run.wall_ms = finished->elapsed_ms;
  run.out = std::move(finished->out);
  run.err = std::move(finished->err);
  run.reported_prefill_ms = reported_prefill_ms(run.out);
  return run;
}

ProviderRun run_provider(const std::vector<std::string>& argv, const std::vector<std::pair<int, int>>& inherit_fds,
                         std::chrono::milliseconds timeout, std::vector<std::string> env) {
  SpawnOptions options;
  options.inherit_fds = inherit_fds;
  options.env = std::move(env);
  options.capture_stdout = true;
  options.capture_stderr = true;
  return provider_run_from(run_child(argv, options, timeout));
}

std::optional<double> reported_prefill_ms(const std::string& out) {
  size_t end = out.find_last_not_of(" \t\r\n");
  if (end == std::string::npos) return std::nullopt;
  size_t begin = out.rfind('\n', end);
  begin = begin == std::string::npos ? 0 : begin + 1;
  const nlohmann::json line = nlohmann::json::parse(out.substr(begin, end - begin + 1), nullptr, false);
  if (!line.is_object()) return std::nullopt;
  auto it = line.find("prefill_ms");
  if (it == line.end() || !it->is_number()) return std::nullopt;
  const double ms = it->get<double>();
  if (!(ms >= 0)) return std::nullopt;
  return ms;
}

}  // namespace kvshare::route
