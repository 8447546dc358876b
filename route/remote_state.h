// serve's side of the remote route's state variant (docs/remote.md, "A stock llama-server
// across hosts"): POST /prefill-state to a kvshare-provider-server, check the bound payload
// it answers (layout/remote_state_payload.h) against what serve expects, and leave the state
// bytes as a file in the decoder's slot directory for an ordinary restore. Works with any
// decoder that restores llama.cpp state files: a stock llama-server needs no patch.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>

#include "layout/error.h"
#include "layout/remote_state_payload.h"
#include "route/decoder_client.h"
#include "route/serve_config.h"

namespace kvshare::route {

// What names serve's model in a binding: the fingerprints of the GGUF serve was given with -m.
struct ModelIdentity {
  std::string model_hash;      // layout::model_fingerprint_hash, as remote_state_hex
  std::string tokenizer_hash;  // layout::tokenizer_fingerprint, as remote_state_hex
};
// Reads the GGUF's metadata (mapped read-only, no tensor data touched) once per path and
// keeps the answer; thread-safe. Errors name the file.
Result<ModelIdentity> model_identity(const std::filesystem::path& model_path);

// The binding serve expects for `ids` handed to a decoder of `config`'s KV flags (-ctk, -ctv,
// -fa) that restores `state_version`. EINVAL naming the flag for a value llama-server refuses.
Result<layout::RemoteStateBinding> expected_state_binding(const ModelIdentity& identity, const ServeConfig& config,
                                                          uint32_t state_version, std::span<const int32_t> ids);

struct FetchedState {
  uint64_t payload_bytes = 0;  // what crossed the network (the reply's body)
  uint64_t state_bytes = 0;    // of it, the state file written
  double prefill_ms = 0;       // the provider server's own figure, else the request's wall time
  double fetch_ms = 0;         // the request's wall time, the reply received and checked
};

// POSTs {"tokens": ids, "binding": expected} to `url`'s /prefill-state with `api_key`
// ("Authorization: Bearer KEY"; empty: none), each connect, read and write bounded by
// `timeout`, checks the reply's binding against `expected` and writes the state bytes to
// `state_path` (created 0600, never over an existing file). `parallel` and `kv_unified`
// describe the decoder's slots (-np, --kv-unified): the file is written for its cache.
// Blocks for the provider's
// prefill. Fails with:
//   EINVAL  a refusal: the provider server answered 400 (its message, naming the field:
//           another model or tokenizer), or its payload's binding differs (check_binding)
//   EACCES  401: the provider server does not take serve's key
//   EPROTO  a payload that does not parse (truncated, another magic), another status
//   ECONNREFUSED/EIO  no answer; open/write errors name `state_path`.
Result<FetchedState> fetch_remote_state(const std::string& url, const std::string& api_key,
                                        std::chrono::milliseconds timeout, std::span<const int32_t> ids,
                                        const layout::RemoteStateBinding& expected,
                                        const std::filesystem::path& state_path, uint32_t parallel = 1,
                                        bool kv_unified = false);

// Whether the decoder answers POST /slots/0?action=share at all (the patched llama-server and
// kvshare-decoder do; a stock llama-server answers "Invalid action"). Sends a body the action
// refuses, so nothing is shared. Fails only when the decoder does not answer.
Result<bool> decoder_speaks_share(const DecoderClient& decoder);

// --prefill-remote-route auto resolved: ucx for a decoder that speaks share, state otherwise.
RemoteRouteKind resolve_remote_route(RemoteRouteKind asked, bool decoder_shares);

}  // namespace kvshare::route
