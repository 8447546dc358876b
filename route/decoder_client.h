// The decoder's HTTP API as the router calls it (llama-server's, and kvshare-decoder's):
// templating, tokenizing and the slot actions of one handoff. Each call opens its own
// loopback connection, so calls from concurrent requests never share a client. The one
// HTTP client of the tree (serve, the benches and the tests use it), so that cpp-httplib
// is compiled with its own options in one place (the Debian library is built with OpenSSL,
// zlib and brotli definitions, which route's CMake target carries).
#pragma once

#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "layout/error.h"

namespace kvshare::route {

struct HttpReply {
  int status = 0;
  std::string body;
  std::string content_type;
  // The body as JSON; a discarded value (is_discarded()) when the body is not JSON.
  nlohmann::json json() const;
};

// A slot action's answer: the HTTP status, the parsed body (null when not JSON) and the
// decoder's own timings (`timings` object), so a caller can tell a refusal from a failure.
struct SlotReply {
  int status = 0;
  nlohmann::json body;
  std::string error_message;  // error.message of a llama-server error body, else the raw body
  bool ok() const { return status == 200 && body.is_object(); }
  // Sum of the numeric fields of body.timings (restore_ms; share_ms + adopt_ms...), nullopt
  // when there is none.
  std::optional<double> timings_ms() const;
};

class DecoderClient {
 public:
  // `timeout` bounds the connect and each read and write. `api_key` (empty: none) goes
  // with every call as "Authorization: Bearer KEY".
  DecoderClient(std::string host, int port, std::chrono::milliseconds timeout, std::string api_key = {});

  const std::string& host() const { return host_; }
  int port() const { return port_; }

  // A header sent with every later call ("X-Api-Key", KEY); replaces one of the same
  // name, the api key's "Authorization" too.
  void set_header(const std::string& name, const std::string& value);

  // Raw calls. Fail only when there is no HTTP answer (connection refused, timeout),
  // naming the path; an HTTP error status is a reply.
  Result<HttpReply> get(const std::string& path) const;
  Result<HttpReply> post_json(const std::string& path, const std::string& body) const;
  Result<HttpReply> post_json(const std::string& path, const nlohmann::json& body) const {
    return post_json(path, body.dump());
  }

  // POST /apply-template with the chat request as it came: the templated prompt text.
  Result<std::string> apply_template(const nlohmann::json& chat_request) const;
  // POST /tokenize with add_special and parse_special on (as the completion path does).
  Result<std::vector<int32_t>> tokenize(const std::string& text) const;

  Result<SlotReply> slot_action(const std::string& action, const nlohmann::json& body, int slot = 0) const;

  // Each slot's context in cells, as the decoder runs it: GET /props, else GET /slots (see
  // slot_context_from_props). llama-server caps -c / -np at the model's training context
  // and says so only in its log. Fails naming both paths when neither tells.
  Result<size_t> slot_context() const;

 private:
  std::string host_;
  int port_;
  std::chrono::milliseconds timeout_;
  std::vector<std::pair<std::string, std::string>> headers_;  // sent with every call
};

// A slot's context from GET /props (`default_generation_settings.n_ctx`, llama-server's
// slot_n_ctx), or from GET /slots (every slot's `n_ctx`: the smallest). EPROTO naming the
// field when it is missing or not a positive count.
Result<size_t> slot_context_from_props(const nlohmann::json& props);
Result<size_t> slot_context_from_slots(const nlohmann::json& slots);

// "error.message" of a llama-server error body, else the body itself (shortened).
std::string error_message_of(const std::string& body);

}  // namespace kvshare::route
