#include "layout/receiver_message.h"

#include <array>
#include <cerrno>
#include <utility>

#include "layout/json_depth.h"
#include "layout/json_reader.h"

namespace kvshare::layout {
namespace {

using Json = nlohmann::ordered_json;

constexpr std::array<std::pair<ReceiverOp, std::string_view>, 5> kOps{{
    {ReceiverOp::hello, "hello"},
    {ReceiverOp::listen, "listen"},
    {ReceiverOp::grant, "grant"},
    {ReceiverOp::complete, "complete"},
    {ReceiverOp::revoke, "revoke"},
}};
constexpr size_t kMaxSocketNameBytes = 100;  // sun_path is 108 with the directory: names stay short

using Reader = JsonReader<nlohmann::json>;

// A share socket's name: a file name in the receiver's private directory.
Result<std::string> socket_name_field(const Reader& read, std::string_view source) {
  auto name = read.text("socket");
  if (!name) return fail(name.error());
  if (name->empty() || name->size() > kMaxSocketNameBytes || name->find('/') != std::string::npos ||
      name->find('\0') != std::string::npos || *name == "." || *name == "..")
    return fail(EINVAL, "{}: \"socket\" must be a file name of 1..{} bytes with no '/' or NUL, not \"{}\"", source,
                kMaxSocketNameBytes, *name);
  return std::move(*name);
}

// The envelope every message shares: an object of this version with a known "op".
Result<std::pair<nlohmann::json, ReceiverOp>> parse_envelope(std::string_view text, std::string_view source) {
  if (text.size() > kMaxReceiverMessageBytes)
    return fail(EMSGSIZE, "{}: {} bytes, the limit is {}", source, text.size(), kMaxReceiverMessageBytes);
  if (json_nesting_depth(text) > kMaxReceiverMessageDepth)
    return fail(EINVAL, "{}: the JSON nests deeper than {} levels", source, kMaxReceiverMessageDepth);
  nlohmann::json json = nlohmann::json::parse(text, nullptr, false);
  if (json.is_discarded()) return fail(EINVAL, "{}: not JSON", source);
  if (!json.is_object()) return fail(EINVAL, "{}: not a JSON object", source);
  const Reader read{json, source};
  auto version = read.u32("version");
  if (!version) return fail(version.error());
  if (*version != kReceiverProtocolVersion)
    return fail(EPROTO,
                "{}: protocol version {}, this side speaks {} (serve and kvshare-remote-receiver come from "
                "one build)",
                source, *version, kReceiverProtocolVersion);
  auto op_text = read.text("op");
  if (!op_text) return fail(op_text.error());
  for (const auto& [op, name] : kOps)
    if (name == *op_text) return std::pair{std::move(json), op};
  return fail(EINVAL, "{}: \"op\" is \"{}\", not one of hello, listen, grant, complete, revoke", source, *op_text);
}

}  // namespace

std::string_view receiver_op_name(ReceiverOp op) {
  for (const auto& [known, name] : kOps)
    if (known == op) return name;
  return "unknown";
}

std::string encode_receiver_request(const ReceiverRequest& request) {
  Json json{{"version", kReceiverProtocolVersion}, {"op", receiver_op_name(request.op)}};
  switch (request.op) {
    case ReceiverOp::listen:
      json["socket"] = request.socket_name;
      break;
    case ReceiverOp::grant:
      json["socket"] = request.socket_name;
      json["n_cells"] = request.n_cells;
      json["n_cached"] = request.n_cached;
      json["timeout_ms"] = request.timeout_ms;
      break;
    case ReceiverOp::complete:
      json["grant_id"] = request.grant_id;
      json["n_tokens"] = request.n_tokens;
      break;
    case ReceiverOp::revoke:
      if (!request.socket_name.empty()) json["socket"] = request.socket_name;
      if (request.grant_id != 0) json["grant_id"] = request.grant_id;
      json["why"] = request.why;
      break;
    case ReceiverOp::hello:
      break;
  }
  return json.dump();
}

std::string encode_receiver_reply(const ReceiverReply& reply) {
  Json json{{"version", kReceiverProtocolVersion}, {"op", receiver_op_name(reply.op)}, {"ok", reply.ok}};
  if (!reply.ok) {
    json["errno"] = reply.error_errno;
    json["error"] = reply.error;
    return json.dump();
  }
  switch (reply.op) {
    case ReceiverOp::hello:
      json["pid"] = reply.pid;
      break;
    case ReceiverOp::listen:
      json["socket"] = reply.socket_path;
      break;
    case ReceiverOp::grant:
      json["share_id"] = reply.share_id;
      json["region"] = reply.region_mapped ? "mapped" : "kept";
      json["region_ms"] = reply.region_ms;
      json["offer"] = reply.offer;
      break;
    case ReceiverOp::complete:
      json["bytes"] = reply.bytes_received;
      break;
    case ReceiverOp::revoke:
      break;
  }
  return json.dump();
}

Result<ReceiverRequest> parse_receiver_request(std::string_view text, std::string_view source) {
  auto envelope = parse_envelope(text, source);
  if (!envelope) return fail(envelope.error());
  const Reader read{envelope->first, source};
  ReceiverRequest request;
  request.op = envelope->second;
  switch (request.op) {
    case ReceiverOp::hello:
      return fail(EINVAL, "{}: \"hello\" is the receiver's word, not a request", source);
    case ReceiverOp::listen: {
      auto name = socket_name_field(read, source);
      if (!name) return fail(name.error());
      request.socket_name = std::move(*name);
      break;
    }
    case ReceiverOp::grant: {
      auto name = socket_name_field(read, source);
      if (!name) return fail(name.error());
      auto n_cells = read.u32("n_cells");
      if (!n_cells) return fail(n_cells.error());
      if (*n_cells == 0) return fail(EINVAL, "{}: \"n_cells\" is 0: a grant has at least one cell", source);
      auto n_cached = read.u32("n_cached");
      if (!n_cached) return fail(n_cached.error());
      if (*n_cached >= *n_cells)
        return fail(EINVAL,
                    "{}: \"n_cached\" is {} of \"n_cells\" {}: the decoder would hold every position, nothing to "
                    "grant",
                    source, *n_cached, *n_cells);
      auto timeout = read.u64("timeout_ms");
      if (!timeout) return fail(timeout.error());
      if (*timeout == 0) return fail(EINVAL, "{}: \"timeout_ms\" is 0", source);
      request.socket_name = std::move(*name);
      request.n_cells = *n_cells;
      request.n_cached = *n_cached;
      request.timeout_ms = *timeout;
      break;
    }
    case ReceiverOp::complete: {
      auto grant = read.u64("grant_id");
      if (!grant) return fail(grant.error());
      auto n_tokens = read.u32("n_tokens");
      if (!n_tokens) return fail(n_tokens.error());
      request.grant_id = *grant;
      request.n_tokens = *n_tokens;
      break;
    }
    case ReceiverOp::revoke: {
      if (read.find("socket") != nullptr) {
        auto name = socket_name_field(read, source);
        if (!name) return fail(name.error());
        request.socket_name = std::move(*name);
      }
      if (read.find("grant_id") != nullptr) {
        auto grant = read.u64("grant_id");
        if (!grant) return fail(grant.error());
        if (*grant == 0)
          return fail(EINVAL, "{}: \"grant_id\" is 0: name a grant (an offer's share_id) or leave the field out",
                      source);
        request.grant_id = *grant;
      }
      auto why = read.text("why");
      if (!why) return fail(why.error());
      request.why = std::move(*why);
      break;
    }
  }
  return request;
}

Result<ReceiverReply> parse_receiver_reply(std::string_view text, std::string_view source) {
  auto envelope = parse_envelope(text, source);
  if (!envelope) return fail(envelope.error());
  const Reader read{envelope->first, source};
  ReceiverReply reply;
  reply.op = envelope->second;
  auto ok = read.boolean("ok");
  if (!ok) return fail(ok.error());
  reply.ok = *ok;
  if (!reply.ok) {
    auto refusal = read.refusal();
    if (!refusal) return fail(refusal.error());
    reply.error_errno = refusal->error_errno;
    reply.error = std::move(refusal->error);
    return reply;
  }
  switch (reply.op) {
    case ReceiverOp::hello: {
      auto pid = read.u64("pid");
      if (!pid) return fail(pid.error());
      reply.pid = *pid;
      break;
    }
    case ReceiverOp::listen: {
      auto path = read.text("socket");
      if (!path) return fail(path.error());
      if (path->empty() || path->front() != '/')
        return fail(EINVAL, "{}: \"socket\" is \"{}\", not an absolute path", source, *path);
      reply.socket_path = std::move(*path);
      break;
    }
    case ReceiverOp::grant: {
      auto share_id = read.u64("share_id");
      if (!share_id) return fail(share_id.error());
      auto region = read.text("region");
      if (!region) return fail(region.error());
      if (*region != "mapped" && *region != "kept")
        return fail(EINVAL, "{}: \"region\" is \"{}\", not \"mapped\" or \"kept\"", source, *region);
      auto region_ms = read.number("region_ms");
      if (!region_ms) return fail(region_ms.error());
      const auto* offer = read.find("offer");
      if (offer == nullptr || !offer->is_object()) return fail(EINVAL, "{}: \"offer\" is not an object", source);
      reply.share_id = *share_id;
      reply.region_mapped = *region == "mapped";
      reply.region_ms = *region_ms;
      reply.offer = *offer;
      break;
    }
    case ReceiverOp::complete: {
      auto bytes = read.u64("bytes");
      if (!bytes) return fail(bytes.error());
      reply.bytes_received = *bytes;
      break;
    }
    case ReceiverOp::revoke:
      break;
  }
  return reply;
}

}  // namespace kvshare::layout
