// A small blocking HTTP client for talking to a decoder (ours or a real llama-server):
// what the tests and tools use, so that cpp-httplib is compiled with its own options in
// one place (the Debian library is built with OpenSSL, zlib and brotli definitions).
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "apps/decoder/api_error.h"
#include "layout/error.h"

namespace kvshare::decoder {

struct HttpReply {
  int status = 0;
  std::string body;
  std::string content_type;
  // The body as JSON; throws nlohmann's parse_error on a body that is not JSON.
  Json json() const;
};

class HttpClient {
 public:
  // `base_url` is "http://HOST:PORT" (no path). Timeouts are per read/write, in seconds.
  HttpClient(std::string base_url, int timeout_s = 120);

  Result<HttpReply> get(const std::string& path) const;
  Result<HttpReply> post(const std::string& path, const std::string& body) const;
  Result<HttpReply> post(const std::string& path, const Json& body) const { return post(path, body.dump()); }

  const std::string& base_url() const { return base_url_; }
  // A header sent with every later call ("Authorization", "Bearer KEY"); replaces one of
  // the same name.
  void set_header(const std::string& name, const std::string& value);

 private:
  std::string base_url_;
  int timeout_s_;
  std::vector<std::pair<std::string, std::string>> headers_;
};

// Splits an SSE body into the payloads of its "data: " lines, checking llama-server's
// framing: every event is exactly one "data: <payload>" line followed by a blank line
// (":"-comment pings are skipped). A body that breaks the framing is an error naming the
// byte offset.
Result<std::vector<std::string>> parse_sse_events(std::string_view body);

}  // namespace kvshare::decoder
