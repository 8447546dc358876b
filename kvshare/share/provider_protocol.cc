#include "kvshare/share/provider_protocol.h"

#include <fmt/format.h>

#include <array>
#include <cerrno>
#include <utility>

#include "layout/json_depth.h"
#include "layout/json_reader.h"

namespace kvshare {
namespace {

using Json = nlohmann::ordered_json;
using Reader = layout::JsonReader<Json>;

constexpr const char* kVersionKey = "kvshare_provider";
constexpr std::array<std::pair<ProviderOp, std::string_view>, 3> kOps{{
    {ProviderOp::hello, "hello"},
    {ProviderOp::region, "region"},
    {ProviderOp::prefill, "prefill"},
}};
// Past 2^53 a JSON number is not an integer every parser keeps exactly.
constexpr uint64_t kMaxId = (uint64_t{1} << 53) - 1;

std::string dump(const Json& json) { return json.dump(-1, ' ', false, Json::error_handler_t::replace); }

// The envelope every message shares: an object of this version with a known "op".
Result<std::pair<Json, ProviderOp>> parse_envelope(std::string_view text, std::string_view source) {
  if (text.size() > kMaxProviderMessageBytes)
    return fail(EMSGSIZE, "{}: {} bytes, the limit is {}", source, text.size(), kMaxProviderMessageBytes);
  if (layout::json_nesting_depth(text) > kMaxProviderMessageDepth)
    return fail(EINVAL, "{}: the JSON nests deeper than {} levels", source, kMaxProviderMessageDepth);
  Json json = Json::parse(text, nullptr, false);
  if (json.is_discarded()) return fail(EINVAL, "{}: not JSON", source);
  if (!json.is_object()) return fail(EINVAL, "{}: not a JSON object", source);
  const Reader read{json, source};
  if (read.find(kVersionKey) == nullptr)
    return fail(EINVAL, "{}: not a kvshare resident provider message (no \"{}\")", source, kVersionKey);
  auto version = read.u32(kVersionKey);
  if (!version) return fail(version.error());
  if (*version != kProviderProtocolVersion)
    return fail(EPROTO, "{}: protocol version {}, this side speaks {} (docs/provider.md, \"The resident provider\")",
                source, *version, kProviderProtocolVersion);
  auto op_text = read.text("op");
  if (!op_text) return fail(op_text.error());
  for (const auto& [op, name] : kOps)
    if (name == *op_text) return std::pair{std::move(json), op};
  return fail(EINVAL, "{}: \"op\" is \"{}\", not one of hello, region, prefill", source, *op_text);
}

Result<uint64_t> id_field(const Reader& read, std::string_view key) {
  auto value = read.u64(key);
  if (!value) return fail(value.error());
  if (*value == 0 || *value > kMaxId)
    return fail(EINVAL, "{}: \"{}\" is {}, expected 1..2^53-1", read.source, key, *value);
  return *value;
}

Result<std::vector<int32_t>> tokens_field(const Reader& read) {
  const Json* tokens = read.find("tokens");
  if (tokens == nullptr) return fail(EINVAL, "{}: no \"tokens\"", read.source);
  if (!tokens->is_array() || tokens->empty())
    return fail(EINVAL, "{}: \"tokens\" is not an array of at least one id", read.source);
  std::vector<int32_t> ids;
  ids.reserve(tokens->size());
  for (size_t i = 0; i < tokens->size(); ++i) {
    const Json& id = (*tokens)[i];
    if (!id.is_number_unsigned() || id.get<uint64_t>() > INT32_MAX)
      return fail(EINVAL, "{}: \"tokens[{}]\" is {}, not a token id 0..2^31-1", read.source, i, dump(id));
    ids.push_back(static_cast<int32_t>(id.get<uint64_t>()));
  }
  return ids;
}

Result<ProviderKvParams> kv_field(const Reader& read) {
  const Json* kv = read.find("kv");
  if (kv == nullptr || !kv->is_object()) return fail(EINVAL, "{}: \"kv\" is not an object", read.source);
  const std::string source = fmt::format("{} \"kv\"", read.source);
  const Reader fields{*kv, source};
  ProviderKvParams params;
  auto n_ctx = fields.u32("n_ctx");
  if (!n_ctx) return fail(n_ctx.error());
  auto type_k = fields.text("type_k");
  if (!type_k) return fail(type_k.error());
  auto type_v = fields.text("type_v");
  if (!type_v) return fail(type_v.error());
  auto flash_attn = fields.boolean("flash_attn");
  if (!flash_attn) return fail(flash_attn.error());
  params.n_ctx = *n_ctx;
  params.type_k = std::move(*type_k);
  params.type_v = std::move(*type_v);
  params.flash_attn = *flash_attn;
  if (fields.find("n_seq_max") != nullptr) {
    auto n_seq_max = fields.u32("n_seq_max");
    if (!n_seq_max) return fail(n_seq_max.error());
    if (*n_seq_max == 0) return fail(EINVAL, "{}: \"n_seq_max\" is 0, expected the decoder's slots (>= 1)", source);
    params.n_seq_max = *n_seq_max;
    params.kv_unified = params.n_seq_max == 1;
  }
  if (fields.find("kv_unified") != nullptr) {
    auto kv_unified = fields.boolean("kv_unified");
    if (!kv_unified) return fail(kv_unified.error());
    params.kv_unified = *kv_unified || params.n_seq_max == 1;
  }
  return params;
}

}  // namespace

std::string_view provider_op_name(ProviderOp op) {
  for (const auto& [known, name] : kOps)
    if (known == op) return name;
  return "unknown";
}

std::string_view prefill_route_name(PrefillRoute route) { return route == PrefillRoute::shared ? "shared" : "file"; }

std::string encode_provider_request(const ProviderRequest& request) {
  Json json{{kVersionKey, kProviderProtocolVersion}, {"op", provider_op_name(request.op)}};
  switch (request.op) {
    case ProviderOp::hello:
      break;
    case ProviderOp::region: {
      json["region_id"] = request.region_id;
      // The share message goes in as the handshake encodes it (its header text spliced, not
      // re-serialized): "share" is the last key.
      std::string text = dump(json);
      text.pop_back();
      text += ",\"share\":";
      text += handshake::encode_json(request.share);
      text += '}';
      return text;
    }
    case ProviderOp::prefill:
      json["route"] = prefill_route_name(request.route);
      if (request.route == PrefillRoute::shared) {
        json["region_id"] = request.region_id;
        json["share_id"] = request.share_id;
        json["stream"] = request.stream;
        if (request.n_cells > 0) {  // a range: written only when the share named one
          json["first_cell"] = request.first_cell;
          json["n_cells"] = request.n_cells;
        }
        json["n_cached"] = request.n_cached;
      } else {
        json["state_file"] = request.state_file;
        json["state_version"] = request.state_version;
        json["kv"] = Json{{"n_ctx", request.kv.n_ctx},
                          {"type_k", request.kv.type_k},
                          {"type_v", request.kv.type_v},
                          {"flash_attn", request.kv.flash_attn}};
        if (request.kv.n_seq_max > 1) {
          json["kv"]["n_seq_max"] = request.kv.n_seq_max;
          json["kv"]["kv_unified"] = request.kv.kv_unified;
        }
      }
      json["tokens"] = request.tokens;
      break;
  }
  return dump(json);
}

std::string encode_provider_reply(const ProviderReply& reply) {
  Json json{{kVersionKey, kProviderProtocolVersion}, {"op", provider_op_name(reply.op)}, {"ok", reply.ok}};
  if (!reply.ok) {
    json["errno"] = reply.error_errno;
    json["error"] = reply.error;
    return dump(json);
  }
  switch (reply.op) {
    case ProviderOp::hello: {
      json["pid"] = reply.pid;
      Json routes = Json::array();
      if (reply.takes_shared) routes.push_back("shared");
      if (reply.takes_file) routes.push_back("file");
      json["routes"] = std::move(routes);
      json["cached"] = reply.takes_cached;
      break;
    }
    case ProviderOp::region:
      json["region_id"] = reply.region_id;
      json["region_ms"] = reply.region_ms;
      break;
    case ProviderOp::prefill:
      json["prefill_ms"] = reply.prefill_ms;
      json["n_prefilled"] = reply.n_prefilled;
      break;
  }
  return dump(json);
}

Result<ProviderRequest> parse_provider_request(std::string_view text, std::string_view source) {
  auto envelope = parse_envelope(text, source);
  if (!envelope) return fail(envelope.error());
  Json& json = envelope->first;
  const Reader read{json, source};
  ProviderRequest request;
  request.op = envelope->second;
  switch (request.op) {
    case ProviderOp::hello:
      return fail(EINVAL, "{}: \"hello\" is the provider's word, not a request", source);
    case ProviderOp::region: {
      auto region_id = id_field(read, "region_id");
      if (!region_id) return fail(region_id.error());
      auto share = json.find("share");
      if (share == json.end() || !share->is_object())
        return fail(EINVAL, "{}: \"share\" is not the decoder's share message (an object)", source);
      auto message = handshake::parse_message_object(*share, fmt::format("{} \"share\"", source));
      if (!message) return fail(message.error());
      if (message->type != handshake::MessageType::share)
        return fail(EINVAL, "{}: \"share\" is a refusal, not a share", source);
      request.region_id = *region_id;
      request.share = std::move(*message);
      break;
    }
    case ProviderOp::prefill: {
      auto route = read.text("route");
      if (!route) return fail(route.error());
      if (*route == "shared") {
        request.route = PrefillRoute::shared;
        auto region_id = id_field(read, "region_id");
        if (!region_id) return fail(region_id.error());
        auto share_id = id_field(read, "share_id");
        if (!share_id) return fail(share_id.error());
        // Absent (a serve from before streams): stream 0, the only one it shared.
        if (read.find("stream") != nullptr) {
          auto stream = read.u32("stream");
          if (!stream) return fail(stream.error());
          request.stream = *stream;
        }
        // Absent (a share that names no range, a serve from before ranges): the whole stream.
        if (read.find("first_cell") != nullptr) {
          auto first_cell = read.u32("first_cell");
          if (!first_cell) return fail(first_cell.error());
          request.first_cell = *first_cell;
        }
        if (read.find("n_cells") != nullptr) {
          auto n_cells = read.u32("n_cells");
          if (!n_cells) return fail(n_cells.error());
          request.n_cells = *n_cells;
        }
        if (request.first_cell > 0 && request.n_cells == 0)
          return fail(EINVAL, "{}: \"first_cell\" is {} without \"n_cells\": a range names its cells", source,
                      request.first_cell);
        auto n_cached = read.u32("n_cached");
        if (!n_cached) return fail(n_cached.error());
        request.region_id = *region_id;
        request.share_id = *share_id;
        request.n_cached = *n_cached;
      } else if (*route == "file") {
        request.route = PrefillRoute::file;
        auto path = read.text("state_file");
        if (!path) return fail(path.error());
        if (path->empty() || path->front() != '/' || path->find('\0') != std::string::npos)
          return fail(EINVAL, "{}: \"state_file\" is \"{}\", not an absolute path", source, *path);
        auto version = read.u32("state_version");
        if (!version) return fail(version.error());
        auto kv = kv_field(read);
        if (!kv) return fail(kv.error());
        request.state_file = std::move(*path);
        request.state_version = *version;
        request.kv = std::move(*kv);
      } else {
        return fail(EINVAL, "{}: \"route\" is \"{}\", not \"shared\" or \"file\"", source, *route);
      }
      auto tokens = tokens_field(read);
      if (!tokens) return fail(tokens.error());
      request.tokens = std::move(*tokens);
      if (request.n_cached >= request.tokens.size())
        return fail(EINVAL, "{}: \"n_cached\" is {}, expected below the {} tokens (at least one id to prefill)", source,
                    request.n_cached, request.tokens.size());
      break;
    }
  }
  return request;
}

Result<ProviderReply> parse_provider_reply(std::string_view text, std::string_view source) {
  auto envelope = parse_envelope(text, source);
  if (!envelope) return fail(envelope.error());
  const Reader read{envelope->first, source};
  ProviderReply reply;
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
    case ProviderOp::hello: {
      auto pid = read.u64("pid");
      if (!pid) return fail(pid.error());
      const auto* routes = read.find("routes");
      if (routes == nullptr || !routes->is_array())
        return fail(EINVAL, "{}: \"routes\" is not an array of route names", source);
      reply.takes_shared = reply.takes_file = false;
      for (const Json& route : *routes) {
        if (route == "shared")
          reply.takes_shared = true;
        else if (route == "file")
          reply.takes_file = true;
        else
          return fail(EINVAL, "{}: \"routes\" holds {}, not \"shared\" or \"file\"", source, dump(route));
      }
      if (!reply.takes_shared && !reply.takes_file) return fail(EINVAL, "{}: \"routes\" names no route", source);
      auto cached = read.boolean("cached");
      if (!cached) return fail(cached.error());
      reply.pid = *pid;
      reply.takes_cached = *cached;
      break;
    }
    case ProviderOp::region: {
      auto region_id = id_field(read, "region_id");
      if (!region_id) return fail(region_id.error());
      auto region_ms = read.number("region_ms");
      if (!region_ms) return fail(region_ms.error());
      reply.region_id = *region_id;
      reply.region_ms = *region_ms;
      break;
    }
    case ProviderOp::prefill: {
      auto prefill_ms = read.number("prefill_ms");
      if (!prefill_ms) return fail(prefill_ms.error());
      auto n_prefilled = read.u32("n_prefilled");
      if (!n_prefilled) return fail(n_prefilled.error());
      reply.prefill_ms = *prefill_ms;
      reply.n_prefilled = *n_prefilled;
      break;
    }
  }
  return reply;
}

Result<void> check_prefill_admitted(const ProviderReply& hello, uint64_t held_region_id,
                                    const ProviderRequest& request) {
  const bool shared = request.route == PrefillRoute::shared;
  if (shared ? !hello.takes_shared : !hello.takes_file)
    return fail(ENOTSUP, "this provider does not take the {} route (its hello offered {})",
                prefill_route_name(request.route), hello.takes_shared ? "shared" : "file");
  if (!shared) return {};
  if (held_region_id == 0 || request.region_id != held_region_id)
    return fail(ESTALE, "{}",
                held_region_id == 0
                    ? fmt::format("region {}: this provider holds no region; send it", request.region_id)
                    : fmt::format("region {}: this provider holds region {}; send region {} again", request.region_id,
                                  held_region_id, request.region_id));
  if (request.n_cached > 0 && !hello.takes_cached)
    return fail(ENOTSUP, "n_cached {}: this provider prefills whole prompts only (its hello said \"cached\": false)",
                request.n_cached);
  return {};
}

}  // namespace kvshare
