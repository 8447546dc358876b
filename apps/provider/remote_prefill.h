// The reference provider on the remote route: prefill a prompt with the CPU transformer
// and push each layer's K and V rows of the granted positions to a decoder on another
// host, as the decoder's offer says (kvshare/remote, docs/remote.md): the whole prompt is
// computed (its later positions attend over the earlier ones) but only positions
// n_cached..n-1 are sent, position p into cell first_cell + p of the offer's stream. The model is loaded once;
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
  uint32_t n_sent = 0;      // positions sent: n_tokens - the offer's n_cached
};

class RemotePrefiller {
 public:
  // Maps and loads the model. Errors name the file.
  static Result<std::unique_ptr<RemotePrefiller>> load(const std::string& model_path, int n_threads);
  ~RemotePrefiller();

  int32_t n_vocab() const;
  // The loaded model, for another route of the same server (POST /prefill-state).
  std::shared_ptr<const Model> model() const;

  // Prefills `tokens` (the whole prompt, positions 0..n-1) and writes the K/V of positions
  // n_cached..n-1 into cells first_cell + p of the offer's stream, then sends the
  // completion. EINVAL: the header does not match this model (names the field), ids
  // outside the vocabulary, more tokens than the offer's n_cells or no more than its
  // n_cached. ECONNREFUSED: the decoder refused a write; ETIMEDOUT: past the offer's
  // deadline; other UCX errors name the step. Blocking. Several runs may go at once on
  // one prefiller: each has its own Context, cache and UCX worker over the shared,
  // read-only model.
  Result<RemotePrefillReport> run(std::span<const int32_t> tokens, const remote::RemoteOffer& offer);

  // The same with another provider doing the prefill (the NPU engine's command, or
  // kvshare-prefill): `command` runs on the file route's contract (`--tokens IDS --out
  // STATE --model M --ctx-size --flash-attn --cache-type-k --cache-type-v`, the decoder's
  // KV params), at most `timeout`; its state file is checked against the offer's layout
  // and the granted positions' rows placed and sent as run() sends them (the command
  // computes the whole prompt). Fails naming the command's exit
  // or the state file's fault (EIO), before any write.
  Result<RemotePrefillReport> run_command(std::span<const int32_t> tokens, const remote::RemoteOffer& offer,
                                          const std::string& command, std::chrono::milliseconds timeout);

 private:
  struct Impl;
  explicit RemotePrefiller(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvshare::refmodel
