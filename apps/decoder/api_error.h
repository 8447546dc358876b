// llama-server's error replies (server-common.cpp format_error_response): every error body
// is {"error": {"code": C, "message": "...", "type": "..."}} and the HTTP status is C.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <tl/expected.hpp>

namespace kvshare::decoder {

// llama-server builds every reply with nlohmann::ordered_json: keys keep insertion order.
using Json = nlohmann::ordered_json;

enum class ErrorType {
  invalid_request,      // 400
  authentication,       // 401
  permission,           // 403
  not_found,            // 404
  server,               // 500
  not_supported,        // 501
  unavailable,          // 503
  exceed_context_size,  // 400, adds n_prompt_tokens and n_ctx
};

struct ApiError {
  ErrorType type = ErrorType::server;
  std::string message;
  int32_t n_prompt_tokens = 0;  // exceed_context_size only
  int32_t n_ctx = 0;            // exceed_context_size only

  int status() const;
  // The object inside "error": code, message, type (+ n_prompt_tokens, n_ctx).
  Json to_json() const;
  // {"error": to_json()}
  std::string body() const;
};

template <class T>
using ApiResult = tl::expected<T, ApiError>;

inline tl::unexpected<ApiError> api_fail(ErrorType type, std::string message) {
  return tl::unexpected<ApiError>(ApiError{type, std::move(message)});
}

std::string_view error_type_name(ErrorType type);

}  // namespace kvshare::decoder
