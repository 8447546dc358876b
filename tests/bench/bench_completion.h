// One streamed completion through kvshare-serve, as the load groups send them (load,
// load-mix): POST /v1/completions, greedy, ignore_eos, stream on; when each event came,
// the first byte and the whole reply measured here.
#pragma once

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "layout/error.h"

namespace kvshare::bench {

struct StreamedCompletion {
  double first_byte_ms = 0;
  double total_ms = 0;
  std::vector<std::chrono::steady_clock::time_point> events;  // when each `data: {` event arrived
  std::string body;                                           // the whole SSE body
};

// The reply, or an error naming what went wrong: the transport cut, a status other than
// 200 (with the body's start), or a reply without one event.
Result<StreamedCompletion> stream_completion(int port, const std::string& prompt, int n_predict);

// The last non-empty line of a log file ("" when there is none): what a serve that did not
// start said last.
std::string last_log_line(const std::filesystem::path& path);

}  // namespace kvshare::bench
