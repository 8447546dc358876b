// kvshare-provider-server's main, as a library function: the prefill host's HTTP service.
//   GET  /health   {"status": "ok"} once the model is loaded
//   POST /prefill  {"tokens": [ids...], "share": <the decoder's offer>}
//        -> 200 {"n_tokens", "prefill_ms", "forward_ms", "transfer_ms", "bytes_sent"}
//        -> 400 {"error": {"message"}} for a body, offer or token list it refuses (before
//           any byte moves), 502 when the transfer failed (the decoder refused a write,
//           left, or the deadline passed)
// One prefill runs at a time (the CPU is the resource). docs/remote.md.
#pragma once

#include <string>

#include <cstdint>
#include <string_view>
#include <vector>

#include "kvshare/remote/remote_offer.h"
#include "layout/error.h"

namespace kvshare::refmodel {

struct ProviderServerOptions {
  std::string model_path;   // -m
  std::string host = "127.0.0.1";
  int port = 8090;          // 0: any free port (printed)
  int n_threads = 0;        // 0: all cores
  // --provider-command: prefill with this program instead (the NPU engine, or
  // kvshare-prefill), on the file route's contract; its state file's rows are sent.
  std::string provider_command;
  double provider_timeout_s = 120;  // --provider-timeout
};

// A /prefill body: token ids (0..INT32_MAX, at least one) and the offer. Errors name the
// field; the size and nesting are bounded before parsing. Exposed for the fuzz target.
struct PrefillBody {
  std::vector<int32_t> tokens;
  remote::RemoteOffer offer;
};
Result<PrefillBody> parse_prefill_body(std::string_view body);

// Loads the model, listens, serves until SIGINT/SIGTERM. Returns 0 after a clean stop,
// 1 when the model or the socket failed (said on stderr).
int run_provider_server(const ProviderServerOptions& options);

}  // namespace kvshare::refmodel
