#include "apps/decoder/api_error.h"

namespace kvshare::decoder {

std::string_view error_type_name(ErrorType type) {
  switch (type) {
    case ErrorType::invalid_request:
      return "invalid_request_error";
    case ErrorType::authentication:
      return "authentication_error";
    case ErrorType::permission:
      return "permission_error";
    case ErrorType::not_found:
      return "not_found_error";
    case ErrorType::server:
      return "server_error";
    case ErrorType::not_supported:
      return "not_supported_error";
    case ErrorType::unavailable:
      return "unavailable_error";
    case ErrorType::exceed_context_size:
      return "exceed_context_size_error";
  }
  return "server_error";
}

int ApiError::status() const {
  switch (type) {
    case ErrorType::invalid_request:
      return 400;
    case ErrorType::authentication:
      return 401;
    case ErrorType::permission:
      return 403;
    case ErrorType::not_found:
      return 404;
    case ErrorType::server:
      return 500;
    case ErrorType::not_supported:
      return 501;
    case ErrorType::unavailable:
      return 503;
    case ErrorType::exceed_context_size:
      return 400;
  }
  return 500;
}

Json ApiError::to_json() const {
  Json error = {
      {"code", status()},
      {"message", message},
      {"type", error_type_name(type)},
  };
  if (type == ErrorType::exceed_context_size) {
    error["n_prompt_tokens"] = n_prompt_tokens;
    error["n_ctx"] = n_ctx;
  }
  return error;
}

std::string ApiError::body() const {
  // Replace invalid UTF-8 instead of throwing: messages may quote request bytes.
  return Json{{"error", to_json()}}.dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace kvshare::decoder
