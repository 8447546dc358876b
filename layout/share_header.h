// The layout header: the JSON document that describes a shared region — format version,
// the model's fingerprint, the KV params, each cache's chunks (size, hash) and each
// tensor's placement. The decoder sends it with the fds; the provider reads it from the
// --layout file. docs/layout.md is its specification; tests/data holds its vector.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "layout/error.h"
#include "layout/gguf_value.h"
#include "layout/kv_params.h"
#include "layout/memory_shape.h"
#include "layout/share_layout.h"

namespace kvshare::layout {

// What identifies "the same model" across two processes without reading weights.
struct ModelFingerprint {
  std::string arch;      // general.architecture
  std::string name;      // general.name, "" when absent
  uint32_t n_layer = 0;  // block_count
  uint32_t n_embd = 0;
  uint32_t n_vocab = 0;       // tokenizer.ggml.tokens count, 0 when absent
  uint64_t tensors_hash = 0;  // FNV-1a over every tensor info (name, type, ne), in file order
  friend bool operator==(const ModelFingerprint&, const ModelFingerprint&) = default;
};

ModelFingerprint model_fingerprint(const GgufMetadata& metadata, const std::vector<GgufTensorInfo>& tensors);
// The fingerprint as one number: FNV-1a 64 over its fields (arch, name, n_layer, n_embd,
// n_vocab, tensors_hash), for a binding that names a model in one field (remote_state_payload.h).
uint64_t model_fingerprint_hash(const ModelFingerprint& model);

// What decides a prompt's token ids: FNV-1a 64 over every "tokenizer.ggml.*" key (the model,
// pre-tokenizer, tokens, types, scores, merges, special ids, add_bos/add_eos), key by key in
// sorted order, each as its name, GGUF type and value. Two files that tokenize alike but
// differ in a chat template (tokenizer.chat_template) hash alike.
uint64_t tokenizer_fingerprint(const GgufMetadata& metadata);

struct ShareHeader {
  static constexpr uint32_t kFormatVersion = 1;
  uint32_t format_version = kFormatVersion;
  ModelFingerprint model;
  KvParams params;
  MemoryShape memory;  // the cache objects (kv_size, n_stream, types, v_trans, layers)
  ShareLayout layout;  // chunks and tensor placements, fd order
};

// Builds the header for a model and params (derives memory shape and share_layout).
Result<ShareHeader> make_share_header(const ModelFingerprint& model, const ModelShape& shape, const KvParams& params);

// Serializes to JSON (stable key order, 2-space indent when `pretty`).
std::string to_json(const ShareHeader& header, bool pretty = true);

// Parses and validates: version, every field's type and range, chunk/tensor consistency
// (offsets 4096-aligned, tensors inside their chunk, hashes recomputed from the tensors).
// Errors name `source` (a file path or "handshake from pid N") and the JSON field.
Result<ShareHeader> parse_share_header(std::string_view json, std::string_view source);
// The same checks on a header already parsed as part of a larger document (the handshake
// message carries it as an object): the JSON is parsed once per handshake, not twice.
// The caller bounds its size and nesting (the handshake caps the whole message).
Result<ShareHeader> parse_share_header_document(const nlohmann::ordered_json& document, std::string_view source);

// Refuses a peer whose header differs from ours in anything that changes the bytes: the
// error names the first differing field and both values, and who we are (`self`), e.g.
// `field "params.type_k" is "q8_0", this provider uses "f16"`.
Result<void> check_compatible(const ShareHeader& ours, const ShareHeader& theirs, std::string_view peer,
                              std::string_view self = "provider");

}  // namespace kvshare::layout
