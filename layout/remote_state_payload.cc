#include "layout/remote_state_payload.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "layout/json_depth.h"
#include "layout/state_format.h"
#include "layout/tensor_type.h"

namespace kvshare::layout {
namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

// The binding is an object of scalars: one level, two with slack for nothing else.
constexpr int kMaxBindingDepth = 2;

constexpr uint64_t kFnvBasis = 0xcbf29ce484222325ull;
constexpr uint64_t kFnvPrime = 1099511628211ull;

void put_le(std::string& out, uint64_t value, int n_bytes) {
  for (int i = 0; i < n_bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

uint64_t get_le(std::span<const std::byte> bytes, size_t offset, int n_bytes) {
  uint64_t value = 0;
  for (int i = 0; i < n_bytes; ++i) value |= static_cast<uint64_t>(bytes[offset + i]) << (8 * i);
  return value;
}

bool is_hash_text(const std::string& text) {
  if (text.size() != 18 || text[0] != '0' || text[1] != 'x') return false;
  for (size_t i = 2; i < text.size(); ++i)
    if (!((text[i] >= '0' && text[i] <= '9') || (text[i] >= 'a' && text[i] <= 'f'))) return false;
  return true;
}

Result<const Json*> field_of(const Json& object, const char* name, std::string_view source) {
  const auto it = object.find(name);
  if (it == object.end()) return fail(EINVAL, "{}: the binding has no field \"{}\"", source, name);
  return &*it;
}

Result<std::string> hash_field(const Json& object, const char* name, std::string_view source) {
  auto field = field_of(object, name, source);
  if (!field) return fail(field.error());
  if (!(*field)->is_string() || !is_hash_text((*field)->get_ref<const std::string&>()))
    return fail(EINVAL, "{}: field \"{}\" is {}, expected \"0x\" and 16 lowercase hex digits", source, name,
                (*field)->dump());
  return (*field)->get<std::string>();
}

Result<uint32_t> count_field(const Json& object, const char* name, std::string_view source) {
  auto field = field_of(object, name, source);
  if (!field) return fail(field.error());
  // A JSON text's "2" parses unsigned; a built document's 2 is signed: both are counts.
  const bool is_count =
      (*field)->is_number_unsigned() || ((*field)->is_number_integer() && (*field)->get<int64_t>() >= 0);
  if (!is_count || (*field)->get<uint64_t>() > UINT32_MAX)
    return fail(EINVAL, "{}: field \"{}\" is {}, expected an unsigned 32-bit count", source, name, (*field)->dump());
  return static_cast<uint32_t>((*field)->get<uint64_t>());
}

Result<std::string> cache_type_field(const Json& object, const char* name, std::string_view source) {
  auto field = field_of(object, name, source);
  if (!field) return fail(field.error());
  if (!(*field)->is_string())
    return fail(EINVAL, "{}: field \"{}\" is {}, expected a ggml type name", source, name, (*field)->dump());
  auto type = parse_cache_type((*field)->get_ref<const std::string&>());
  if (!type) return fail(EINVAL, "{}: field \"{}\": {}", source, name, type.error().message());
  return std::string(ggml_type_name(*type));
}

std::string fa_words(bool v_trans) { return v_trans ? "V transposed (-fa off)" : "V not transposed (-fa on)"; }

}  // namespace

std::string remote_state_hex(uint64_t value) { return fmt::format("{:#018x}", value); }

uint64_t remote_state_tokens_hash(std::span<const int32_t> ids) {
  uint64_t hash = kFnvBasis;
  for (int32_t id : ids)
    for (int i = 0; i < 4; ++i) hash = (hash ^ ((static_cast<uint32_t>(id) >> (8 * i)) & 0xff)) * kFnvPrime;
  return hash;
}

OrderedJson remote_state_binding_json(const RemoteStateBinding& b) {
  OrderedJson j;
  j["model"] = b.model;
  j["tokenizer"] = b.tokenizer;
  j["state_version"] = b.state_version;
  j["n_tokens"] = b.n_tokens;
  j["tokens_hash"] = b.tokens_hash;
  j["cache_type_k"] = b.cache_type_k;
  j["cache_type_v"] = b.cache_type_v;
  j["v_trans"] = b.v_trans;
  return j;
}

Result<RemoteStateBinding> parse_remote_state_binding(const Json& object, std::string_view source) {
  if (!object.is_object()) return fail(EINVAL, "{}: the binding is {}, not a JSON object", source, object.type_name());
  RemoteStateBinding b;
  auto model = hash_field(object, "model", source);
  if (!model) return fail(model.error());
  b.model = std::move(*model);
  auto tokenizer = hash_field(object, "tokenizer", source);
  if (!tokenizer) return fail(tokenizer.error());
  b.tokenizer = std::move(*tokenizer);
  auto version = count_field(object, "state_version", source);
  if (!version) return fail(version.error());
  if (!is_known_state_version(*version))
    return fail(EINVAL, "{}: field \"state_version\" is {}, expected 2 or 3 (llama.cpp's LLAMA_STATE_SEQ_VERSION)",
                source, *version);
  b.state_version = *version;
  auto n_tokens = count_field(object, "n_tokens", source);
  if (!n_tokens) return fail(n_tokens.error());
  if (*n_tokens == 0) return fail(EINVAL, "{}: field \"n_tokens\" is 0, expected at least one token", source);
  b.n_tokens = *n_tokens;
  auto tokens_hash = hash_field(object, "tokens_hash", source);
  if (!tokens_hash) return fail(tokens_hash.error());
  b.tokens_hash = std::move(*tokens_hash);
  auto type_k = cache_type_field(object, "cache_type_k", source);
  if (!type_k) return fail(type_k.error());
  b.cache_type_k = std::move(*type_k);
  auto type_v = cache_type_field(object, "cache_type_v", source);
  if (!type_v) return fail(type_v.error());
  b.cache_type_v = std::move(*type_v);
  auto v_trans = field_of(object, "v_trans", source);
  if (!v_trans) return fail(v_trans.error());
  if (!(*v_trans)->is_boolean())
    return fail(EINVAL, "{}: field \"v_trans\" is {}, expected true or false", source, (*v_trans)->dump());
  b.v_trans = (*v_trans)->get<bool>();
  return b;
}

std::string encode_remote_state_prefix(const RemoteStateBinding& binding, uint64_t state_bytes) {
  const std::string json = remote_state_binding_json(binding).dump();
  std::string out(kRemoteStateMagic, sizeof(kRemoteStateMagic));
  put_le(out, kRemoteStateVersion, 2);
  put_le(out, 0, 2);
  put_le(out, json.size(), 4);
  put_le(out, state_bytes, 8);
  out += json;
  return out;
}

std::vector<std::byte> encode_remote_state(const RemoteStateBinding& binding, std::span<const std::byte> state) {
  const std::string prefix = encode_remote_state_prefix(binding, state.size());
  std::vector<std::byte> out(prefix.size() + state.size());
  std::memcpy(out.data(), prefix.data(), prefix.size());
  if (!state.empty()) std::memcpy(out.data() + prefix.size(), state.data(), state.size());
  return out;
}

Result<RemoteStatePayload> parse_remote_state(std::span<const std::byte> bytes, std::string_view source) {
  if (bytes.size() < kRemoteStateHeaderBytes)
    return fail(EPROTO, "{}: {} bytes, shorter than the {}-byte header of a remote state payload", source, bytes.size(),
                kRemoteStateHeaderBytes);
  if (std::memcmp(bytes.data(), kRemoteStateMagic, sizeof(kRemoteStateMagic)) != 0)
    return fail(EINVAL, "{}: magic {:#010x} at offset 0, expected \"KVSP\" (not a remote state payload)", source,
                get_le(bytes, 0, 4));
  RemoteStatePayload payload;
  payload.version = static_cast<uint16_t>(get_le(bytes, 4, 2));
  if (payload.version != kRemoteStateVersion)
    return fail(EINVAL, "{}: payload version {} at offset 4, this reader knows version {}", source, payload.version,
                kRemoteStateVersion);
  if (const uint64_t reserved = get_le(bytes, 6, 2); reserved != 0)
    return fail(EINVAL, "{}: reserved field at offset 6 is {}, expected 0", source, reserved);
  const uint64_t binding_bytes = get_le(bytes, 8, 4);
  const uint64_t state_bytes = get_le(bytes, 12, 8);
  if (binding_bytes == 0 || binding_bytes > kMaxBindingBytes)
    return fail(EMSGSIZE, "{}: binding_bytes at offset 8 is {}, expected 1..{}", source, binding_bytes,
                kMaxBindingBytes);
  if (state_bytes == 0 || state_bytes > kMaxRemoteStateBytes)
    return fail(EMSGSIZE, "{}: state_bytes at offset 12 is {}, expected 1..{}", source, state_bytes,
                kMaxRemoteStateBytes);
  const uint64_t available = bytes.size() - kRemoteStateHeaderBytes;
  if (binding_bytes > available)
    return fail(EPROTO, "{}: the binding is {} bytes at offset {}, the payload ends {} bytes after it (truncated)",
                source, binding_bytes, kRemoteStateHeaderBytes, available);
  if (state_bytes != available - binding_bytes)
    return fail(EPROTO, "{}: the state is {} bytes at offset {}, the payload holds {} after the binding ({})", source,
                state_bytes, kRemoteStateHeaderBytes + binding_bytes, available - binding_bytes,
                state_bytes > available - binding_bytes ? "truncated" : "trailing bytes");
  const std::string_view json(reinterpret_cast<const char*>(bytes.data()) + kRemoteStateHeaderBytes,
                              static_cast<size_t>(binding_bytes));
  if (json_nesting_depth(json) > kMaxBindingDepth)
    return fail(EINVAL, "{}: the binding at offset {} nests deeper than {} levels", source, kRemoteStateHeaderBytes,
                kMaxBindingDepth);
  const Json object = Json::parse(json, nullptr, false);
  if (object.is_discarded())
    return fail(EINVAL, "{}: the binding at offset {} is not JSON", source, kRemoteStateHeaderBytes);
  auto binding = parse_remote_state_binding(object, source);
  if (!binding) return fail(binding.error());
  payload.binding = std::move(*binding);
  payload.state = bytes.subspan(kRemoteStateHeaderBytes + binding_bytes);
  return payload;
}

Result<void> check_binding(const RemoteStateBinding& expected, const RemoteStateBinding& got, std::string_view peer) {
  if (got.model != expected.model)
    return fail(EINVAL,
                "{}: field \"model\": the remote state is for model {}, this decoder runs {}: give the provider "
                "server the decoder's model (the GGUF kvshare-serve runs with -m)",
                peer, got.model, expected.model);
  if (got.tokenizer != expected.tokenizer)
    return fail(EINVAL,
                "{}: field \"tokenizer\": the remote state's ids come from tokenizer {}, this decoder's is {}: give "
                "the provider server a GGUF with the decoder's tokenizer",
                peer, got.tokenizer, expected.tokenizer);
  if (got.state_version != expected.state_version)
    return fail(EINVAL,
                "{}: field \"state_version\": the remote state is of version {}, this decoder restores version {} "
                "only: the provider server must write the version serve asks for (update kvshare-provider-server)",
                peer, got.state_version, expected.state_version);
  if (got.n_tokens != expected.n_tokens || got.tokens_hash != expected.tokens_hash)
    return fail(EINVAL,
                "{}: field \"{}\": the remote state holds {} tokens (hash {}), serve handed over {} (hash {}): the "
                "provider server prefilled another token list",
                peer, got.n_tokens != expected.n_tokens ? "n_tokens" : "tokens_hash", got.n_tokens, got.tokens_hash,
                expected.n_tokens, expected.tokens_hash);
  if (got.cache_type_k != expected.cache_type_k)
    return fail(EINVAL,
                "{}: field \"cache_type_k\": the remote state's K cache is {}, this decoder runs -ctk {}: the "
                "provider server must write the KV types serve asks for",
                peer, got.cache_type_k, expected.cache_type_k);
  if (got.cache_type_v != expected.cache_type_v)
    return fail(EINVAL,
                "{}: field \"cache_type_v\": the remote state's V cache is {}, this decoder runs -ctv {}: the "
                "provider server must write the KV types serve asks for",
                peer, got.cache_type_v, expected.cache_type_v);
  if (got.v_trans != expected.v_trans)
    return fail(EINVAL,
                "{}: field \"v_trans\": the remote state has {}, this decoder has {}: the provider server must "
                "write the layout serve asks for",
                peer, fa_words(got.v_trans), fa_words(expected.v_trans));
  return {};
}

}  // namespace kvshare::layout
