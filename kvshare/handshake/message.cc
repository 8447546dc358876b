#include "kvshare/handshake/message.h"

#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "layout/json_depth.h"
#include "layout/json_reader.h"

namespace kvshare::handshake {
namespace {

using Json = nlohmann::ordered_json;

// The message's top-level key that also says "this is a kvshare handshake" and its version.
constexpr const char* kVersionKey = "kvshare_handshake";
// Nesting past this is refused before parsing: a header is 5 levels deep, and the JSON
// library's dump() recurses.
constexpr int kMaxDepth = 32;

std::string dump(const Json& json) { return json.dump(-1, ' ', false, Json::error_handler_t::replace); }

std::string hash_text(uint64_t hash) { return fmt::format("0x{:016x}", hash); }

bool is_known_kind(std::string_view kind) {
  return kind == "memfd" || kind == "udmabuf" || kind == "dmaheap" || kind == "device";
}

using Reader = layout::JsonReader<Json>;

// "0x" and 16 lowercase hex digits, as hash_text writes them.
Result<uint64_t> hash_field(const Reader& read, std::string_view key) {
  auto text = read.text(key);
  if (!text) return fail(text.error());
  const bool well_formed = text->size() == 18 && text->rfind("0x", 0) == 0 &&
                           text->find_first_not_of("0123456789abcdef", 2) == std::string::npos;
  if (!well_formed)
    return fail(EINVAL, "{}: field \"{}{}\" is \"{}\", expected \"0x\" and 16 lowercase hex digits", read.source,
                read.path, key, *text);
  return std::stoull(text->substr(2), nullptr, 16);
}

Result<FdEntry> parse_fd_entry(const Json& entry, std::string_view source, size_t index) {
  if (!entry.is_object())
    return fail(EINVAL, "{}: field \"fds[{}]\" is {}, expected an object", source, index, dump(entry));
  const std::string path = fmt::format("fds[{}].", index);
  const Reader read{entry, source, path};
  FdEntry fd;
  auto chunk = read.u64("chunk", kMaxFds);
  if (!chunk) return fail(chunk.error());
  if (*chunk != index)
    return fail(EINVAL, "{}: field \"{}chunk\" is {}, expected {} (fds go in chunk order)", source, path, *chunk,
                index);
  fd.chunk = static_cast<uint32_t>(*chunk);
  auto kind = read.text("kind");
  if (!kind) return fail(kind.error());
  if (!is_known_kind(*kind))
    return fail(EINVAL, "{}: field \"{}kind\" is \"{}\", expected memfd, udmabuf, dmaheap or device", source, path,
                *kind);
  fd.kind = std::move(*kind);
  auto offset = read.u64("offset", uint64_t{1} << 62);
  if (!offset) return fail(offset.error());
  if (*offset % 4096 != 0)
    return fail(EINVAL, "{}: field \"{}offset\" is {}, expected a multiple of 4096", source, path, *offset);
  fd.offset = *offset;
  auto size = read.u64("size_bytes", uint64_t{1} << 62);
  if (!size) return fail(size.error());
  if (*size == 0 || *size % 4096 != 0)
    return fail(EINVAL, "{}: field \"{}size_bytes\" is {}, expected a positive multiple of 4096", source, path, *size);
  fd.size_bytes = *size;
  auto hash = hash_field(read, "layout_hash");
  if (!hash) return fail(hash.error());
  fd.layout_hash = *hash;
  return fd;
}

Result<Message> parse_object(Json& json, std::string_view peer, bool header_is_known) {
  // Every error says which peer sent the message: "handshake from pid 4121: ...".
  const std::string source = fmt::format("handshake from {}", peer);
  if (!json.is_object())
    return fail(EINVAL, "{}: message is {}, expected a JSON object", source, std::string(json.type_name()));
  if (!json.contains(kVersionKey))
    return fail(EINVAL, "{}: not a kvshare handshake message (no field \"{}\")", source, kVersionKey);
  const Reader read{json, source};
  Message message;
  auto version = read.u32(kVersionKey);
  if (!version) return fail(version.error());
  if (*version == 0 || *version > kProtocolVersion)
    return fail(EPROTO,
                "{}: field \"{}\" is {}, this side speaks version {}; use the same kvshare on "
                "both sides",
                source, kVersionKey, *version, kProtocolVersion);
  message.version = *version;
  auto type = read.text("type");
  if (!type) return fail(type.error());
  if (*type == "share")
    message.type = MessageType::share;
  else if (*type == "refuse")
    message.type = MessageType::refuse;
  else
    return fail(EINVAL, "{}: field \"type\" is \"{}\", expected \"share\" or \"refuse\"", source, *type);
  auto share_id = read.u64("share_id", (uint64_t{1} << 53) - 1);
  if (!share_id) return fail(share_id.error());
  message.share_id = *share_id;

  if (message.type == MessageType::refuse) {
    auto field_name = read.text("field");
    if (!field_name) return fail(field_name.error());
    auto reason = read.text("reason");
    if (!reason) return fail(reason.error());
    if (reason->empty()) return fail(EINVAL, "{}: field \"reason\" is empty", source);
    message.field = std::move(*field_name);
    message.reason = std::move(*reason);
    return message;
  }

  if (message.share_id == 0) return fail(EINVAL, "{}: field \"share_id\" is 0; shares count from 1", source);
  // Absent "stream": a decoder from before streams, which shared stream 0 only. Absent
  // "first_cell"/"n_cells": the whole stream (a decoder from before ranges, or no range).
  for (auto [key, value] : {std::pair<const char*, uint32_t*>{"stream", &message.stream},
                            std::pair<const char*, uint32_t*>{"first_cell", &message.first_cell},
                            std::pair<const char*, uint32_t*>{"n_cells", &message.n_cells}}) {
    auto number = read.optional_u64(key, UINT32_MAX);
    if (!number) return fail(number.error());
    if (*number) *value = static_cast<uint32_t>(**number);
  }
  auto fds = read.value("fds");
  if (!fds) return fail(fds.error());
  if (!(*fds)->is_array() || (*fds)->empty() || (*fds)->size() > kMaxFds)
    return fail(EINVAL, "{}: field \"fds\" must be an array of 1..{} entries", source, kMaxFds);
  for (size_t i = 0; i < (*fds)->size(); ++i) {
    auto entry = parse_fd_entry((**fds)[i], source, i);
    if (!entry) return fail(entry.error());
    message.fds.push_back(std::move(*entry));
  }
  if (header_is_known) {
    message.header_is_known = true;
    return message;
  }
  auto header = read.value("header");
  if (!header) return fail(header.error());
  if (!(*header)->is_object())
    return fail(EINVAL, "{}: field \"header\" is {}, expected the layout header object", source,
                std::string((*header)->type_name()));
  message.header = std::move(json["header"]);  // moved, not copied: the message owns it now
  return message;
}

}  // namespace

Result<Message> parse_message_object(nlohmann::ordered_json& json, std::string_view source) {
  return parse_object(json, source, false);
}

std::string_view message_type_name(MessageType type) { return type == MessageType::share ? "share" : "refuse"; }

std::string encode_json(const Message& message) {
  Json json;
  json[kVersionKey] = message.version;
  json["type"] = std::string(message_type_name(message.type));
  json["share_id"] = message.share_id;
  if (message.type == MessageType::refuse) {
    json["field"] = message.field;
    json["reason"] = message.reason;
    return dump(json);
  }
  json["stream"] = message.stream;
  if (message.n_cells > 0 || message.first_cell > 0) {
    json["first_cell"] = message.first_cell;
    json["n_cells"] = message.n_cells;
  }
  Json fds = Json::array();
  for (const auto& fd : message.fds) {
    Json entry;
    entry["chunk"] = fd.chunk;
    entry["kind"] = fd.kind;
    entry["offset"] = fd.offset;
    entry["size_bytes"] = fd.size_bytes;
    entry["layout_hash"] = hash_text(fd.layout_hash);
    fds.push_back(std::move(entry));
  }
  json["fds"] = std::move(fds);
  // "header" is the last key: the envelope is dumped without it and the header's text is
  // spliced in, so a 20-40 KB header is neither parsed nor re-serialized per share.
  // header_json must be one JSON object (layout::to_json's); if it is not, the peer's
  // parse refuses the message by name.
  std::string text = dump(json);
  text.pop_back();  // the envelope's closing brace
  text += ",\"header\":";
  if (!message.header_json.empty())
    text += message.header_json;
  else
    text += dump(message.header);
  text += '}';
  return text;
}

std::vector<std::byte> length_prefixed(std::string_view body) {
  std::vector<std::byte> frame(kLengthBytes + body.size());
  const uint32_t length = static_cast<uint32_t>(body.size());
  for (size_t i = 0; i < kLengthBytes; ++i) frame[i] = static_cast<std::byte>((length >> (8 * i)) & 0xff);
  std::memcpy(frame.data() + kLengthBytes, body.data(), body.size());
  return frame;
}

Result<std::vector<std::byte>> encode_frame(const Message& message) {
  const std::string json = encode_json(message);
  if (json.size() > kMaxMessageBytes)
    return fail(EMSGSIZE, "handshake message is {} bytes, the limit is {}", json.size(), kMaxMessageBytes);
  return length_prefixed(json);
}

namespace {

// The envelope of `text` when it ends with `,"header":` + known_header + `}`; empty otherwise.
std::string_view envelope_before_known_header(std::string_view text, std::string_view known_header) {
  constexpr std::string_view kKey = ",\"header\":";
  if (known_header.empty() || text.size() < kKey.size() + known_header.size() + 2) return {};
  const size_t header_at = text.size() - 1 - known_header.size();
  if (text.back() != '}' || text.substr(header_at, known_header.size()) != known_header) return {};
  if (text.substr(header_at - kKey.size(), kKey.size()) != kKey) return {};
  return text.substr(0, header_at - kKey.size());
}

}  // namespace

Result<Message> parse_json(std::string_view text, std::string_view source, std::string_view known_header) {
  if (text.size() > kMaxMessageBytes)
    return fail(EMSGSIZE, "handshake from {}: message is {} bytes, the limit is {}", source, text.size(),
                kMaxMessageBytes);
  if (const auto envelope = envelope_before_known_header(text, known_header); !envelope.empty()) {
    std::string object(envelope);
    object += '}';
    if (layout::json_nesting_depth(object) <= kMaxDepth) {
      Json json = Json::parse(object, nullptr, false);
      // A whole object of its own, with no "header" of its own: then the full text is that
      // object plus the known header, and parsing it in full would give the same message.
      if (!json.is_discarded() && json.is_object() && !json.contains("header")) return parse_object(json, source, true);
    }
  }
  if (layout::json_nesting_depth(text) > kMaxDepth)
    return fail(EINVAL, "handshake from {}: JSON nests deeper than {} levels", source, kMaxDepth);
  Json json;
  try {
    json = Json::parse(text);
  } catch (const Json::exception& error) {
    return fail(EINVAL, "handshake from {}: message is not valid JSON: {}", source, error.what());
  }
  return parse_object(json, source, false);
}

Result<Message> parse_frame(std::span<const std::byte> frame, std::string_view source, std::string_view known_header) {
  if (frame.size() < kLengthBytes)
    return fail(EPROTO, "handshake from {}: frame is {} bytes, shorter than its 4-byte length", source, frame.size());
  uint32_t length = 0;
  for (size_t i = 0; i < kLengthBytes; ++i) length |= static_cast<uint32_t>(frame[i]) << (8 * i);
  if (length > kMaxMessageBytes)
    return fail(EMSGSIZE, "handshake from {}: length prefix says {} bytes, the limit is {}", source, length,
                kMaxMessageBytes);
  if (frame.size() - kLengthBytes != length)
    return fail(EPROTO, "handshake from {}: length prefix says {} bytes, the frame carries {}", source, length,
                frame.size() - kLengthBytes);
  return parse_json(std::string_view(reinterpret_cast<const char*>(frame.data()) + kLengthBytes, length), source,
                    known_header);
}

Message make_refusal(uint64_t share_id, std::string field, std::string reason) {
  Message message;
  message.type = MessageType::refuse;
  message.share_id = share_id;
  message.field = std::move(field);
  message.reason = std::move(reason);
  return message;
}

}  // namespace kvshare::handshake
