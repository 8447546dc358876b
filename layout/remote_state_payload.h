// The remote state payload: a llama.cpp sequence-state file bound to what it was computed
// for, as a kvshare-provider-server answers POST /prefill-state (docs/remote.md, "A stock
// llama-server across hosts"). A decoder that restores a state file checks neither the model
// nor the tokens nor the KV types it holds, so the envelope names them and serve refuses a
// payload whose binding differs from its own before a byte reaches the decoder.
//
//   offset  size  field
//   0       4     magic "KVSP"
//   4       2     version, u16 little-endian (1)
//   6       2     reserved, 0
//   8       4     binding_bytes, u32 little-endian (1..kMaxBindingBytes)
//   12      8     state_bytes, u64 little-endian (1..kMaxRemoteStateBytes)
//   20      B     the binding: a JSON object, compact, keys in RemoteStateBinding's order
//   20+B    S     the sequence-state bytes (llama_state_seq_save_file's format)
// Pure: encodes and decodes spans; nothing here opens a file or a socket.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "layout/error.h"

namespace kvshare::layout {

inline constexpr char kRemoteStateMagic[4] = {'K', 'V', 'S', 'P'};
inline constexpr uint16_t kRemoteStateVersion = 1;
inline constexpr size_t kRemoteStateHeaderBytes = 20;
// A binding is eight short fields (~300 bytes); anything near this is not one.
inline constexpr size_t kMaxBindingBytes = 4096;
// What serve accepts in memory from one reply: a 128k-token prompt of a large model in f16.
inline constexpr uint64_t kMaxRemoteStateBytes = uint64_t{16} << 30;
// The reply header in which the provider server gives its prefill time in ms (the body is
// the payload alone).
inline constexpr const char* kRemoteStatePrefillMsHeader = "X-Kvshare-Prefill-Ms";
// What POST /prefill-state answers a payload as.
inline constexpr const char* kRemoteStateContentType = "application/octet-stream";

// What the state bytes were computed for. Hashes are "0x" and 16 lowercase hex digits.
struct RemoteStateBinding {
  std::string model;           // model_fingerprint_hash of the GGUF (share_header.h)
  std::string tokenizer;       // tokenizer_fingerprint of the GGUF
  uint32_t state_version = 0;  // LLAMA_STATE_SEQ_VERSION of the file: 2 or 3
  uint32_t n_tokens = 0;       // ids in the state (the prompt less its last token), >= 1
  std::string tokens_hash;     // remote_state_tokens_hash of those ids
  std::string cache_type_k;    // ggml type name, as -ctk ("f16", "q8_0")
  std::string cache_type_v;    // as -ctv
  bool v_trans = false;        // V stored transposed: the decoder runs -fa off
  friend bool operator==(const RemoteStateBinding&, const RemoteStateBinding&) = default;
};

// "0x" and 16 lowercase hex digits.
std::string remote_state_hex(uint64_t value);
// FNV-1a 64 over the ids, each as 4 bytes little-endian.
uint64_t remote_state_tokens_hash(std::span<const int32_t> ids);

// The binding as its JSON object (keys in the struct's order), and back. The parse refuses
// (EINVAL, naming `source` and the field) a missing or mistyped field, a hash that is not
// "0x" + 16 hex digits, a state_version other than 2 or 3, n_tokens 0 and a cache type
// name that is not a ggml type; other keys are ignored.
nlohmann::ordered_json remote_state_binding_json(const RemoteStateBinding& binding);
Result<RemoteStateBinding> parse_remote_state_binding(const nlohmann::json& object, std::string_view source);

struct RemoteStatePayload {
  uint16_t version = kRemoteStateVersion;
  RemoteStateBinding binding;
  std::span<const std::byte> state;  // borrowed from the parsed bytes
};

// The header and the binding, for `state_bytes` bytes of state to follow (so a sender can
// append a file it has read without a second copy).
std::string encode_remote_state_prefix(const RemoteStateBinding& binding, uint64_t state_bytes);
// The whole payload.
std::vector<std::byte> encode_remote_state(const RemoteStateBinding& binding, std::span<const std::byte> state);

// Decodes a payload; never reads past `bytes`. EINVAL naming `source`, the field and the
// byte offset: another magic, another version, a reserved field not 0, a binding that is not
// a JSON object (or nests deeper than 2 levels) or fails parse_remote_state_binding;
// EMSGSIZE for a binding past kMaxBindingBytes or state past kMaxRemoteStateBytes (before
// anything is parsed); EPROTO when the bytes end before the header, the binding or the state
// says, or go on after it (a truncated or padded reply).
Result<RemoteStatePayload> parse_remote_state(std::span<const std::byte> bytes, std::string_view source);

// Refuses (EINVAL) a binding `got` from `peer` that differs from `expected` in any field:
// the message names the field, both values and the fix, e.g. "the remote state is for model
// 0x…, this decoder runs 0x…: give the provider server the decoder's model (-m)".
Result<void> check_binding(const RemoteStateBinding& expected, const RemoteStateBinding& got, std::string_view peer);

}  // namespace kvshare::layout
