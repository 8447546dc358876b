// kvshare-provider-server's main, as a library function: the prefill host's HTTP service.
//   GET  /health   {"status": "ok", "prefilling": N, "waiting": W} once the model is loaded
//   POST /prefill  {"tokens": [ids...], "share": <the decoder's offer>}
//        -> 200 {"n_tokens", "n_sent", "prefill_ms", "forward_ms", "transfer_ms", "bytes_sent"}
//        -> 400 {"error": {"message"}} for a body, offer or token list it refuses (before
//           any byte moves), 502 when the transfer failed (the decoder refused a write,
//           left, or the deadline passed), 503 at once when --parallel prefills run and
//           --queue requests wait already
//   POST /prefill-state  {"tokens": [ids...], "binding": {...}} -> the bound state payload
//        for a stock llama-server decoder (apps/provider/state_prefill.h)
// Up to --parallel prefills run at once (each its own Context and cache over the one
// mapped model), up to --queue more wait their turn in arrival order. Every request but GET /health
// needs the deployment's key ("Authorization: Bearer KEY" or "X-Api-Key: KEY", as
// llama-server, route/api_key.h) and is otherwise answered 401: the service
// prefills and pushes KV rows into whichever decoder an offer names. docs/remote.md.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "kvshare/remote/remote_offer.h"
#include "layout/error.h"

namespace kvshare::refmodel {

struct ProviderServerOptions {
  std::string model_path;  // -m
  std::string host = "127.0.0.1";
  int port = 8090;    // 0: any free port (printed)
  int n_threads = 0;  // 0: all cores
  // --provider-command: prefill with this program instead (the NPU engine, or
  // kvshare-prefill), on the file route's contract; its state file's rows are sent.
  std::string provider_command;
  double provider_timeout_s = 120;  // --provider-timeout
  int parallel = 1;                 // --parallel: prefills at once
  int queue = 16;                   // --queue: requests waiting for a prefill slot; past it, 503
  // The keys a request must carry (resolve_provider_keys); empty only with --no-api-key,
  // then every request passes and the start says so.
  std::vector<std::string> api_keys;
};

// The environment variable that gives the key (one key, the whole value), as serve's side
// of the hop reads it too.
inline constexpr const char* kRemoteKeyEnv = "KVSHARE_REMOTE_KEY";

// Where the deployment's key may come from; every one given adds its keys.
struct ProviderKeySources {
  std::string api_key;            // --api-key: comma-separated keys, as llama-server
  std::string api_key_file;       // --api-key-file: one key per line, "#" lines are comments
  const char* env_key = nullptr;  // KVSHARE_REMOTE_KEY's value; null when unset
  bool no_api_key = false;        // --no-api-key: serve without a key, explicitly
};

// The keys the server will accept. EINVAL (bad usage) when no source gives a key and
// --no-api-key is not set (the message names the three ways to give one), when
// --no-api-key comes with a key, when KVSHARE_REMOTE_KEY is set but empty, or when the
// key file holds no key; ENOENT/EACCES naming the key file. No message shows a key.
Result<std::vector<std::string>> resolve_provider_keys(const ProviderKeySources& sources);

// A /prefill body: token ids (0..INT32_MAX, at least one) and the offer. Errors name the
// field; the size and nesting are bounded before parsing. Exposed for the fuzz target.
struct PrefillBody {
  std::vector<int32_t> tokens;
  remote::RemoteOffer offer;
};
Result<PrefillBody> parse_prefill_body(std::string_view body);

// Admission for /prefill: at most `parallel` run, at most `queue` wait (first come, first
// served); a request past both is refused at once. Exposed for its unit test.
class PrefillSlots {
 public:
  PrefillSlots(int parallel, int queue) : parallel_(parallel), queue_(queue) {}
  // Takes a slot, waiting in line if all are busy; false (at once) when the line is full.
  bool acquire();
  void release();
  int prefilling() const;
  int waiting() const;
  // The 503 sentence: "the provider server is busy: N prefilling, Q waiting (--queue Q)".
  std::string busy_message() const;

 private:
  const int parallel_;
  const int queue_;
  mutable std::mutex mutex_;
  std::condition_variable turn_;
  int prefilling_ = 0;
  int waiting_ = 0;
  uint64_t next_ticket_ = 0;  // arrival order of the waiting requests
  uint64_t serving_ = 0;      // the ticket whose turn is next
};

// Loads the model, listens, serves until SIGINT/SIGTERM. Returns 0 after a clean stop,
// 1 when the model or the socket failed (said on stderr). A refused request is 401 with
// llama-server's body and one stderr line naming the method, path and peer, never the key.
int run_provider_server(const ProviderServerOptions& options);

}  // namespace kvshare::refmodel
