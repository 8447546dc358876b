// kvshare-provider-server's POST /prefill-state: the remote route's state variant, for a
// decoder that is a stock llama-server (docs/remote.md, "A stock llama-server across hosts").
//   POST /prefill-state  {"tokens": [ids...], "binding": {...}}   (the binding serve expects)
//        -> 200 application/octet-stream: the bound payload (layout/remote_state_payload.h),
//           a llama.cpp sequence-state file of the ids in the asked state version and KV types
//        -> 400 {"error": {"message"}} naming the field: a body it cannot read, a binding for
//           another model or tokenizer, ids that are not the binding's, ids outside the
//           vocabulary; all before any compute
//        -> 502 when the prefill or the provider command failed
// The state file is written by the file route's writer (prefill_state_file, i.e.
// statefile::StateFileWriter) or by --provider-command on the file route's contract.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "layout/error.h"
#include "layout/remote_state_payload.h"

namespace kvshare::refmodel {

class Model;  // refmodel/engine.h

// A /prefill-state body: token ids (0..INT32_MAX, at least one) and the binding the caller
// expects back. EINVAL naming the field; size and nesting bounded before parsing. Exposed
// for tests.
struct StatePrefillBody {
  std::vector<int32_t> tokens;
  layout::RemoteStateBinding binding;
  // The decoder's slots, as llama-server's -np and --kv-unified: a state file carries one KV
  // stream per slot unless unified, so it must be written for the decoder's cache. Optional
  // fields "parallel" (1..256, default 1) and "kv_unified" (default false).
  uint32_t parallel = 1;
  bool kv_unified = false;
};
Result<StatePrefillBody> parse_state_prefill_body(std::string_view body);

// One answer, for the HTTP server to send as it is; a 200 also carries the prefill time
// (the state file written, the command's run included) in the header
// layout::kRemoteStatePrefillMsHeader.
struct StatePrefillAnswer {
  int status = 200;
  std::string content_type;
  std::string body;
  double prefill_ms = 0;
};

class StatePrefiller {
 public:
  // Over a model already loaded (the server's /prefill route's); `model_path` names it in
  // messages and goes to --provider-command as --model.
  StatePrefiller(std::shared_ptr<const Model> model, std::string model_path, int n_threads);
  ~StatePrefiller();

  // The model's and its tokenizer's fingerprints, as a binding names them.
  const std::string& model_hash() const;
  const std::string& tokenizer_hash() const;

  // Answers one request: checks the body and its binding against this model (400 naming
  // the field), then prefills (the caller holds one of its prefill slots; or runs `provider_command`, at
  // most `timeout`), and answers the payload. Writes one stderr line per request (tokens,
  // prefill ms, bytes), or the refusal. Never throws.
  StatePrefillAnswer answer(std::string_view body, const std::string& provider_command,
                            std::chrono::milliseconds timeout);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvshare::refmodel
