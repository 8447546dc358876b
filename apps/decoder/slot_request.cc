#include "apps/decoder/slot_request.h"

#include <fmt/format.h>

#include <limits>

#include "apps/decoder/slot_filename.h"

namespace kvshare::decoder {
namespace {

// share and adopt answer a body that is not JSON with 400 naming the action.
ApiResult<Json> parse_action_body(std::string_view action, std::string_view body) {
  try {
    return Json::parse(body);
  } catch (const std::exception& e) {
    return api_fail(ErrorType::invalid_request, fmt::format("{}: body is not JSON: {}", action, e.what()));
  }
}

// A JSON array of token ids (0..2^31-1) for `field` of `action`; the vocabulary is the
// slot's to check.
ApiResult<std::vector<int32_t>> parse_token_array(std::string_view action, std::string_view field, const Json& value) {
  if (!value.is_array())
    return api_fail(ErrorType::invalid_request, fmt::format("{}: \"{}\" must be an array of token ids", action, field));
  std::vector<int32_t> tokens;
  tokens.reserve(value.size());
  for (size_t i = 0; i < value.size(); ++i) {
    const Json& t = value[i];
    // A token id outside int32 would wrap into another id; refuse it instead.
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > std::numeric_limits<int32_t>::max())
      return api_fail(ErrorType::invalid_request,
                      fmt::format("{}: \"{}\" must hold token ids only: element {} is {}, not an integer from 0 to "
                                  "2147483647",
                                  action, field, i, t.dump()));
    tokens.push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  return tokens;
}

}  // namespace

ApiResult<SlotFileRequest> parse_slot_file_request(std::string_view body) {
  std::string filename;
  try {
    const Json json = Json::parse(body);
    filename = json.at("filename").get<std::string>();
  } catch (const std::exception& e) {
    return api_fail(ErrorType::server, e.what());
  }
  if (!is_valid_slot_filename(filename)) return api_fail(ErrorType::invalid_request, "Invalid filename");
  return SlotFileRequest{std::move(filename)};
}

ApiResult<ShareRequest> parse_share_request(std::string_view body) {
  auto json = parse_action_body("share", body);
  if (!json) return tl::unexpected(json.error());
  auto socket = json->is_object() ? json->find("socket") : json->end();
  if (!json->is_object() || socket == json->end() || !socket->is_string() || socket->get<std::string>().empty())
    return api_fail(ErrorType::invalid_request,
                    "share: the body must be {\"socket\": \"<path of the AF_UNIX socket>\"}");
  ShareRequest request;
  request.socket = socket->get<std::string>();
  if (auto tokens = json->find("tokens"); tokens != json->end() && !tokens->is_null()) {
    auto parsed = parse_token_array("share", "tokens", *tokens);
    if (!parsed) return tl::unexpected(parsed.error());
    request.tokens = std::move(*parsed);
  }
  return request;
}

ApiResult<AdoptRequest> parse_adopt_request(std::string_view body) {
  auto json = parse_action_body("adopt", body);
  if (!json) return tl::unexpected(json.error());
  const bool has_tokens = json->is_object() && json->contains("tokens") && json->at("tokens").is_array();
  const bool has_share_id =
      json->is_object() && json->contains("share_id") && json->at("share_id").is_number_unsigned();
  if (!has_tokens || !has_share_id)
    return api_fail(ErrorType::invalid_request,
                    "adopt: the body must be {\"tokens\": [ids...], \"share_id\": N} with N the share_id a share "
                    "returned");
  AdoptRequest request;
  auto tokens = parse_token_array("adopt", "tokens", json->at("tokens"));
  if (!tokens) return tl::unexpected(tokens.error());
  request.tokens = std::move(*tokens);
  request.share_id = json->at("share_id").get<uint64_t>();
  if (auto n_cached = json->find("n_cached"); n_cached != json->end() && !n_cached->is_null()) {
    if (!n_cached->is_number_unsigned() || n_cached->get<uint64_t>() > request.tokens.size())
      return api_fail(ErrorType::invalid_request,
                      fmt::format("adopt: \"n_cached\" is {}; it must be an integer from 0 to the {} tokens given "
                                  "(the n_cached the share answered)",
                                  n_cached->dump(), request.tokens.size()));
    request.n_cached = static_cast<uint32_t>(n_cached->get<uint64_t>());
  }
  return request;
}

}  // namespace kvshare::decoder
