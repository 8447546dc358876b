#include "kvshare/remote/remote_offer.h"

#include <cerrno>
#include <limits>

#include "layout/json_depth.h"
#include "layout/remote_grant.h"

namespace kvshare::remote {
namespace {

// The header is the deepest part of an offer (tensors inside chunks inside the layout).
constexpr int kMaxOfferDepth = 16;

Result<std::vector<std::byte>> from_hex(std::string_view text, std::string_view source) {
  if (text.empty() || text.size() % 2 != 0 || text.size() / 2 > kMaxWorkerAddressBytes)
    return fail(EINVAL, "offer from {}: \"worker_address\" is {} hex digits, expected an even count of 2..{}", source,
                text.size(), 2 * kMaxWorkerAddressBytes);
  std::vector<std::byte> out(text.size() / 2);
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < out.size(); ++i) {
    const int hi = digit(text[2 * i]), lo = digit(text[2 * i + 1]);
    if (hi < 0 || lo < 0)
      return fail(EINVAL, "offer from {}: \"worker_address\" has a character other than 0-9a-f at {}", source, 2 * i);
    out[i] = static_cast<std::byte>(hi * 16 + lo);
  }
  return out;
}

Result<layout::RemoteSecret> secret_field(const nlohmann::json& json, std::string_view source) {
  constexpr size_t kDigits = 2 * layout::kRemoteSecretBytes;
  auto it = json.find("secret");
  if (it == json.end() || !it->is_string())
    return fail(EINVAL, "offer from {}: field \"secret\" is missing or not a string ({} lowercase hex digits)", source,
                kDigits);
  const std::string& text = it->get_ref<const std::string&>();
  if (text.size() != kDigits)
    return fail(EINVAL, "offer from {}: field \"secret\" is {} characters, expected {} lowercase hex digits", source,
                text.size(), kDigits);
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  layout::RemoteSecret secret{};
  for (size_t i = 0; i < secret.size(); ++i) {
    const int hi = digit(text[2 * i]), lo = digit(text[2 * i + 1]);
    // The position only, never the text: the secret must not reach a log.
    if (hi < 0 || lo < 0)
      return fail(EINVAL, "offer from {}: field \"secret\" has a character other than 0-9a-f at {}", source,
                  hi < 0 ? 2 * i : 2 * i + 1);
    secret[i] = static_cast<std::byte>(hi * 16 + lo);
  }
  if (layout::same_secret(secret, layout::RemoteSecret{}))
    return fail(EINVAL, "offer from {}: field \"secret\" is all zeros, not a drawn secret", source);
  return secret;
}

template <class T>
Result<T> unsigned_field(const nlohmann::json& json, const char* key, std::string_view source) {
  auto it = json.find(key);
  if (it == json.end() || !it->is_number_unsigned())
    return fail(EINVAL, "offer from {}: field \"{}\" is missing or not an unsigned integer", source, key);
  const uint64_t v = it->get<uint64_t>();
  if (v > std::numeric_limits<T>::max())
    return fail(EINVAL, "offer from {}: field \"{}\" is {}, past {}", source, key, v, std::numeric_limits<T>::max());
  return static_cast<T>(v);
}

}  // namespace

std::string to_hex(const std::vector<std::byte>& bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (std::byte b : bytes) {
    out += kDigits[static_cast<unsigned>(b) >> 4];
    out += kDigits[static_cast<unsigned>(b) & 0xf];
  }
  return out;
}

nlohmann::ordered_json to_json(const RemoteOffer& offer) {
  nlohmann::ordered_json json;
  json["transport"] = kTransportUcx;
  json["version"] = offer.version;
  json["share_id"] = offer.share_id;
  json["secret"] = to_hex(std::vector<std::byte>(offer.secret.begin(), offer.secret.end()));
  json["worker_address"] = to_hex(offer.worker_address);
  json["stream"] = offer.stream;
  json["first_cell"] = offer.first_cell;
  json["n_cached"] = offer.n_cached;
  json["n_cells"] = offer.n_cells;
  json["bytes"] = offer.bytes;
  json["layout_hash"] = offer.layout_hash;
  json["timeout_ms"] = offer.timeout_ms;
  json["header"] = nlohmann::ordered_json::parse(layout::to_json(offer.header, false));
  return json;
}

Result<layout::CellGrant> offer_grant(const RemoteOffer& offer) {
  return layout::grant_cells(offer.header.layout, offer.header.memory, offer.stream, offer.first_cell, offer.n_cached,
                             offer.n_cells);
}

Result<RemoteOffer> parse_offer(const nlohmann::json& json, std::string_view source) {
  if (!json.is_object()) return fail(EINVAL, "offer from {}: not a JSON object", source);
  auto transport = json.find("transport");
  if (transport == json.end() || !transport->is_string() || transport->get<std::string>() != kTransportUcx)
    return fail(EINVAL, "offer from {}: field \"transport\" must be \"ucx\"", source);
  RemoteOffer offer;
  auto version = unsigned_field<uint32_t>(json, "version", source);
  if (!version) return fail(version.error());
  if (*version == 1)
    return fail(EINVAL,
                "offer from {}: version 1, this side speaks version {} (version 2 added the share's "
                "\"secret\", version 3 the grant's stream and cells; update the decoder)",
                source, kOfferVersion);
  if (*version == 2)
    return fail(EINVAL,
                "offer from {}: version 2, this side speaks version {} (version 2 grants cells 0..n-1 of one "
                "stream; version 3 names \"stream\", \"first_cell\" and \"n_cached\": update the decoder "
                "and the provider together)",
                source, kOfferVersion);
  if (*version != kOfferVersion)
    return fail(EINVAL, "offer from {}: version {}, this side speaks version {}", source, *version, kOfferVersion);
  auto share_id = unsigned_field<uint64_t>(json, "share_id", source);
  auto stream = unsigned_field<uint32_t>(json, "stream", source);
  auto first_cell = unsigned_field<uint32_t>(json, "first_cell", source);
  auto n_cached = unsigned_field<uint32_t>(json, "n_cached", source);
  auto n_cells = unsigned_field<uint32_t>(json, "n_cells", source);
  auto bytes = unsigned_field<uint64_t>(json, "bytes", source);
  auto hash = unsigned_field<uint64_t>(json, "layout_hash", source);
  auto timeout = unsigned_field<uint64_t>(json, "timeout_ms", source);
  for (const auto* f : {&share_id, &bytes, &hash, &timeout})
    if (!*f) return fail(f->error());
  for (const auto* f : {&stream, &first_cell, &n_cached, &n_cells})
    if (!*f) return fail(f->error());
  if (*share_id == 0) return fail(EINVAL, "offer from {}: field \"share_id\" is 0", source);
  auto secret = secret_field(json, source);
  if (!secret) return fail(secret.error());
  auto address = json.find("worker_address");
  if (address == json.end() || !address->is_string())
    return fail(EINVAL, "offer from {}: field \"worker_address\" is missing or not a string", source);
  auto address_bytes = from_hex(address->get<std::string>(), source);
  if (!address_bytes) return fail(address_bytes.error());
  auto header_it = json.find("header");
  if (header_it == json.end() || !header_it->is_object())
    return fail(EINVAL, "offer from {}: field \"header\" is missing or not an object", source);
  // The header parser reads an ordered document; the text round trip keeps its key order.
  auto header = layout::parse_share_header_document(nlohmann::ordered_json::parse(header_it->dump()), source);
  if (!header) return fail(header.error());
  offer.version = *version;
  offer.share_id = *share_id;
  offer.secret = *secret;
  offer.worker_address = std::move(*address_bytes);
  offer.stream = *stream;
  offer.first_cell = *first_cell;
  offer.n_cached = *n_cached;
  offer.n_cells = *n_cells;
  offer.bytes = *bytes;
  offer.layout_hash = *hash;
  offer.timeout_ms = *timeout;
  offer.header = std::move(*header);
  auto grant = offer_grant(offer);
  if (!grant) return fail(grant.error().with_context(fmt::format("offer from {}", source)));
  const uint64_t expected_bytes = layout::granted_bytes(*grant);
  if (offer.bytes != expected_bytes)
    return fail(EINVAL, "offer from {}: \"bytes\" is {}, the header gives {} for cells {}..{} of stream {}", source,
                offer.bytes, expected_bytes, grant->cell_begin, grant->cell_end - 1, grant->stream);
  const uint64_t expected_hash = layout::whole_layout_hash(offer.header.layout);
  if (offer.layout_hash != expected_hash)
    return fail(EINVAL, "offer from {}: \"layout_hash\" is {:#x}, the header hashes to {:#x}", source,
                offer.layout_hash, expected_hash);
  return offer;
}

Result<RemoteOffer> parse_offer_text(std::string_view text, std::string_view source) {
  if (text.size() > kMaxOfferBytes)
    return fail(EMSGSIZE, "offer from {}: {} bytes, the limit is {}", source, text.size(), kMaxOfferBytes);
  if (layout::json_nesting_depth(text) > kMaxOfferDepth)
    return fail(EINVAL, "offer from {}: JSON nests deeper than {} levels", source, kMaxOfferDepth);
  nlohmann::json json = nlohmann::json::parse(text, nullptr, false);
  if (json.is_discarded()) return fail(EINVAL, "offer from {}: not valid JSON", source);
  return parse_offer(json, source);
}

}  // namespace kvshare::remote
