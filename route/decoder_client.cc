#include "route/decoder_client.h"

#include <httplib.h>

#include <fmt/format.h>

#include <strings.h>

#include <cerrno>

namespace kvshare::route {
namespace {

using Json = nlohmann::json;

void configure(httplib::Client& client, std::chrono::milliseconds timeout,
               const std::vector<std::pair<std::string, std::string>>& headers) {
  client.set_default_headers(httplib::Headers(headers.begin(), headers.end()));
  client.set_connection_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
  client.set_read_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
  client.set_write_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
  client.set_keep_alive(false);
}

Result<HttpReply> to_reply(const httplib::Result& result, std::string_view what, const std::string& host, int port) {
  if (!result)
    return fail(
        result.error() == httplib::Error::Read || result.error() == httplib::Error::Connection ? ECONNREFUSED : EIO,
        "decoder at {}:{}: {}: no answer ({})", host, port, what, httplib::to_string(result.error()));
  HttpReply reply;
  reply.status = result->status;
  reply.body = result->body;
  reply.content_type = result->get_header_value("Content-Type");
  return reply;
}

}  // namespace

Json HttpReply::json() const { return Json::parse(body, nullptr, false); }

std::optional<double> SlotReply::timings_ms() const {
  if (!body.is_object()) return std::nullopt;
  auto timings = body.find("timings");
  if (timings == body.end() || !timings->is_object()) return std::nullopt;
  double sum = 0;
  bool any = false;
  for (const auto& [key, value] : timings->items()) {
    if (value.is_number() && key.size() > 3 && key.compare(key.size() - 3, 3, "_ms") == 0) {
      sum += value.get<double>();
      any = true;
    }
  }
  return any ? std::optional<double>(sum) : std::nullopt;
}

std::string error_message_of(const std::string& body) {
  const Json json = Json::parse(body, nullptr, false);
  if (json.is_object()) {
    auto error = json.find("error");
    if (error != json.end() && error->is_object()) {
      auto message = error->find("message");
      if (message != error->end() && message->is_string()) return message->get<std::string>();
    }
  }
  return body.size() > 200 ? body.substr(0, 200) + "..." : body;
}

DecoderClient::DecoderClient(std::string host, int port, std::chrono::milliseconds timeout, std::string api_key)
    : host_(std::move(host)), port_(port), timeout_(timeout) {
  if (!api_key.empty()) headers_.emplace_back("Authorization", "Bearer " + api_key);
}

void DecoderClient::set_header(const std::string& name, const std::string& value) {
  for (auto& header : headers_) {
    if (::strcasecmp(header.first.c_str(), name.c_str()) == 0) {  // header names ignore case
      header.second = value;
      return;
    }
  }
  headers_.emplace_back(name, value);
}

Result<HttpReply> DecoderClient::get(const std::string& path) const {
  httplib::Client client(host_, port_);
  configure(client, timeout_, headers_);
  return to_reply(client.Get(path), "GET " + path, host_, port_);
}

Result<HttpReply> DecoderClient::post_json(const std::string& path, const std::string& body) const {
  httplib::Client client(host_, port_);
  configure(client, timeout_, headers_);
  return to_reply(client.Post(path, body, "application/json"), "POST " + path, host_, port_);
}

Result<std::string> DecoderClient::apply_template(const Json& chat_request) const {
  auto reply = post_json("/apply-template", chat_request.dump());
  if (!reply) return fail(reply.error());
  if (reply->status != 200)
    return fail(EINVAL, "POST /apply-template answered {}: {}", reply->status, error_message_of(reply->body));
  const Json json = reply->json();
  if (!json.is_object() || !json.contains("prompt") || !json["prompt"].is_string())
    return fail(EPROTO, "POST /apply-template: reply has no string field \"prompt\"");
  return json["prompt"].get<std::string>();
}

Result<std::vector<int32_t>> DecoderClient::tokenize(const std::string& text) const {
  const Json request = {{"content", text}, {"add_special", true}, {"parse_special", true}};
  auto reply = post_json("/tokenize", request.dump());
  if (!reply) return fail(reply.error());
  if (reply->status != 200)
    return fail(EINVAL, "POST /tokenize answered {}: {}", reply->status, error_message_of(reply->body));
  const Json json = reply->json();
  if (!json.is_object() || !json.contains("tokens") || !json["tokens"].is_array())
    return fail(EPROTO, "POST /tokenize: reply has no array field \"tokens\"");
  std::vector<int32_t> ids;
  ids.reserve(json["tokens"].size());
  for (size_t i = 0; i < json["tokens"].size(); ++i) {
    const Json& id = json["tokens"][i];
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
      return fail(EPROTO, "POST /tokenize: field \"tokens[{}]\" is {}, expected a token id", i, id.dump());
    ids.push_back(id.get<int32_t>());
  }
  return ids;
}

namespace {

// A positive cell count at `field` of `object`, named `where` in the refusal.
Result<size_t> positive_count(const Json& object, const char* field, const std::string& where) {
  if (!object.is_object() || !object.contains(field)) return fail(EPROTO, "{}: no field \"{}\"", where, field);
  const Json& value = object[field];
  if (!value.is_number_integer() || value.get<int64_t>() <= 0)
    return fail(EPROTO, "{}: field \"{}\" is {}, expected a positive count of cells", where, field, value.dump());
  return static_cast<size_t>(value.get<int64_t>());
}

}  // namespace

Result<size_t> slot_context_from_props(const Json& props) {
  if (!props.is_object() || !props.contains("default_generation_settings"))
    return fail(EPROTO, "GET /props: no object \"default_generation_settings\"");
  return positive_count(props["default_generation_settings"], "n_ctx", "GET /props default_generation_settings");
}

Result<size_t> slot_context_from_slots(const Json& slots) {
  if (!slots.is_array() || slots.empty()) return fail(EPROTO, "GET /slots: not a non-empty array of slots");
  size_t smallest = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    auto n_ctx = positive_count(slots[i], "n_ctx", fmt::format("GET /slots [{}]", i));
    if (!n_ctx) return n_ctx;
    if (smallest == 0 || *n_ctx < smallest) smallest = *n_ctx;
  }
  return smallest;
}

Result<size_t> DecoderClient::slot_context() const {
  std::string props_error;
  if (auto props = get("/props"); !props)
    props_error = props.error().what();
  else if (props->status != 200)
    props_error = fmt::format("GET /props answered {}", props->status);
  else if (auto n_ctx = slot_context_from_props(props->json()); n_ctx)
    return n_ctx;
  else
    props_error = n_ctx.error().what();
  auto slots = get("/slots");
  if (!slots) return fail(slots.error().errno_value(), "{}; {}", props_error, slots.error().message());
  if (slots->status != 200) return fail(EPROTO, "{}; GET /slots answered {}", props_error, slots->status);
  auto n_ctx = slot_context_from_slots(slots->json());
  if (!n_ctx) return fail(EPROTO, "{}; {}", props_error, n_ctx.error().what());
  return n_ctx;
}

Result<SlotReply> DecoderClient::slot_action(const std::string& action, const Json& body, int slot) const {
  auto reply = post_json(fmt::format("/slots/{}?action={}", slot, action), body.dump());
  if (!reply) return fail(reply.error());
  SlotReply answer;
  answer.status = reply->status;
  answer.body = reply->json();
  if (answer.body.is_discarded()) answer.body = nullptr;
  if (reply->status != 200) answer.error_message = error_message_of(reply->body);
  return answer;
}

}  // namespace kvshare::route
