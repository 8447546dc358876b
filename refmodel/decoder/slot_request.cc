#include "refmodel/decoder/slot_request.h"

#include <fmt/format.h>

#include <limits>

#include "refmodel/decoder/slot_filename.h"

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
    return api_fail(ErrorType::invalid_request, "share: the body must be {\"socket\": \"<path of the AF_UNIX socket>\"}");
  ShareRequest request;
  request.socket = socket->get<std::string>();
  return request;
}

ApiResult<AdoptRequest> parse_adopt_request(std::string_view body) {
  auto json = parse_action_body("adopt", body);
  if (!json) return tl::unexpected(json.error());
  const bool has_tokens = json->is_object() && json->contains("tokens") && json->at("tokens").is_array();
  const bool has_share_id = json->is_object() && json->contains("share_id") && json->at("share_id").is_number_unsigned();
  if (!has_tokens || !has_share_id)
    return api_fail(ErrorType::invalid_request,
                    "adopt: the body must be {\"tokens\": [ids...], \"share_id\": N} with N the share_id a share "
                    "returned");
  AdoptRequest request;
  for (const auto& t : json->at("tokens")) {
    // A token id outside int32 would wrap into another id; refuse it instead.
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > std::numeric_limits<int32_t>::max())
      return api_fail(ErrorType::invalid_request, "adopt: \"tokens\" must hold token ids only");
    request.tokens.push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  request.share_id = json->at("share_id").get<uint64_t>();
  return request;
}

}  // namespace kvshare::decoder
