// The reference provider on the remote route: prefill a prompt with the CPU transformer
// and push each layer's K and V rows for cells 0..n-1 to a decoder on another host, as
// the decoder's offer says (kvshare/remote, docs/remote.md). The model is loaded once;
// every prefill checks the offer's layout header against it before connecting, so an
// incompatible decoder is refused before any byte moves.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "kvshare/remote/remote_offer.h"
#include "layout/error.h"

namespace kvshare::refmodel {

class Model;  // refmodel/engine.h

struct RemotePrefillReport {
  uint32_t n_tokens = 0;
  double prefill_ms = 0;    // forward pass + placing + sending, until the completion is flushed
  double forward_ms = 0;    // the transformer alone
  double transfer_ms = 0;   // placing rows and waiting on UCX
  uint64_t bytes_sent = 0;  // payload bytes the decoder accepted
};

class RemotePrefiller {
 public:
  // Maps and loads the model. Errors name the file.
  static Result<std::unique_ptr<RemotePrefiller>> load(const std::string& model_path, int n_threads);
  ~RemotePrefiller();

  int32_t n_vocab() const;
  // The loaded model, for another route of the same server (POST /prefill-state).
  std::shared_ptr<const Model> model() const;

  // Prefills `tokens` and writes their K/V into cells 0..tokens.size()-1 of the offer's
  // decoder, then sends the completion. EINVAL: the header does not match this model
  // (names the field), ids outside the vocabulary, more tokens than granted cells.
  // ECONNREFUSED: the decoder refused a write; ETIMEDOUT: past the offer's deadline;
  // other UCX errors name the step. Blocking; callers serialize.
  Result<RemotePrefillReport> run(std::span<const int32_t> tokens, const remote::RemoteOffer& offer);

  // The same with another provider doing the prefill (the NPU engine's command, or
  // kvshare-prefill): `command` runs on the file route's contract (`--tokens IDS --out
  // STATE --model M --ctx-size --flash-attn --cache-type-k --cache-type-v`, the decoder's
  // KV params), at most `timeout`; its state file is checked against the offer's layout
  // and its rows placed and sent as run() sends them. Fails naming the command's exit
  // or the state file's fault (EIO), before any write.
  Result<RemotePrefillReport> run_command(std::span<const int32_t> tokens, const remote::RemoteOffer& offer,
                                          const std::string& command, std::chrono::milliseconds timeout);

 private:
  struct Impl;
  explicit RemotePrefiller(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvshare::refmodel
