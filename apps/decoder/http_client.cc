#include "apps/decoder/http_client.h"

#include <httplib.h>

#include <cerrno>

namespace kvshare::decoder {
namespace {

HttpReply to_reply(const httplib::Result& result) {
  HttpReply reply;
  reply.status = result->status;
  reply.body = result->body;
  reply.content_type = result->get_header_value("Content-Type");
  return reply;
}

}  // namespace

Json HttpReply::json() const { return Json::parse(body); }

HttpClient::HttpClient(std::string base_url, int timeout_s) : base_url_(std::move(base_url)), timeout_s_(timeout_s) {}

void HttpClient::set_header(const std::string& name, const std::string& value) {
  for (auto& header : headers_) {
    if (header.first == name) {
      header.second = value;
      return;
    }
  }
  headers_.emplace_back(name, value);
}

Result<HttpReply> HttpClient::get(const std::string& path) const {
  httplib::Client client(base_url_);
  client.set_read_timeout(timeout_s_, 0);
  client.set_write_timeout(timeout_s_, 0);
  const httplib::Headers headers(headers_.begin(), headers_.end());
  auto result = client.Get(path.c_str(), headers);
  if (!result) return fail(ECONNREFUSED, "GET {}{}: {}", base_url_, path, httplib::to_string(result.error()));
  return to_reply(result);
}

Result<HttpReply> HttpClient::post(const std::string& path, const std::string& body) const {
  httplib::Client client(base_url_);
  client.set_read_timeout(timeout_s_, 0);
  client.set_write_timeout(timeout_s_, 0);
  const httplib::Headers headers(headers_.begin(), headers_.end());
  auto result = client.Post(path.c_str(), headers, body, "application/json");
  if (!result) return fail(ECONNREFUSED, "POST {}{}: {}", base_url_, path, httplib::to_string(result.error()));
  return to_reply(result);
}

Result<std::vector<std::string>> parse_sse_events(std::string_view body) {
  std::vector<std::string> events;
  size_t offset = 0;
  while (offset < body.size()) {
    const size_t end = body.find("\n\n", offset);
    if (end == std::string_view::npos) {
      return fail(EINVAL, "SSE body: event at byte {} is not terminated by a blank line", offset);
    }
    const std::string_view event = body.substr(offset, end - offset);
    if (!event.empty() && event.front() == ':') {
      offset = end + 2;  // a ping comment
      continue;
    }
    if (event.substr(0, 6) != "data: ") {
      return fail(EINVAL, "SSE body: event at byte {} does not start with \"data: \"", offset);
    }
    if (event.find('\n') != std::string_view::npos) {
      return fail(EINVAL, "SSE body: event at byte {} spans several lines", offset);
    }
    events.emplace_back(event.substr(6));
    offset = end + 2;
  }
  return events;
}

}  // namespace kvshare::decoder
