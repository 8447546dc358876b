#include "bench_completion.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <sstream>

#include "bench_files.h"
#include "route/upstream_stream.h"

namespace kvshare::bench {

Result<StreamedCompletion> stream_completion(int port, const std::string& prompt, int n_predict) {
  route::UpstreamStream::Request request;
  request.host = "127.0.0.1";
  request.port = port;
  request.method = "POST";
  request.path = "/v1/completions";
  request.body =
      nlohmann::json{
          {"prompt", prompt}, {"max_tokens", n_predict}, {"temperature", 0}, {"ignore_eos", true}, {"stream", true}}
          .dump();
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto stream = route::UpstreamStream::start(request, nullptr);
  auto head = stream->wait_head();
  if (!head) return fail(head.error());
  StreamedCompletion reply;
  std::string piece;
  while (stream->next(piece)) {
    const auto now = Clock::now();
    if (reply.body.empty()) reply.first_byte_ms = std::chrono::duration<double, std::milli>(now - start).count();
    for (size_t at = piece.find("data: {"); at != std::string::npos; at = piece.find("data: {", at + 1))
      reply.events.push_back(now);
    reply.body += piece;
  }
  reply.total_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  if (auto cut = stream->transport_error()) return fail(*cut);
  stream.reset();
  if (head->status != 200) return fail(EPROTO, "HTTP {}: {}", head->status, reply.body.substr(0, 200));
  if (reply.events.empty()) return fail(EPROTO, "a reply without one token: {}", reply.body.substr(0, 200));
  return reply;
}

std::string last_log_line(const std::filesystem::path& path) {
  std::stringstream text(read_all(path));
  std::string last;
  for (std::string line; std::getline(text, line);)
    if (!line.empty()) last = line;
  return last;
}

}  // namespace kvshare::bench
