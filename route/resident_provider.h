// serve's side of a resident prefill provider (docs/provider.md, "The resident provider"):
// one provider process kept across requests, so the model is loaded, the device opened and
// the decoder's region mapped once, not per request. Started by serve
// (`--prefill-provider PROG --provider-resident`: PROG --model M [--elfs DIR] --serve-fd 3)
// or reached at a socket another supervisor's provider listens on
// (`--prefill-provider-socket PATH`), and supervised as route/resident_process.h
// says: a provider that exits, breaks the protocol or does not answer within the provider
// timeout is killed (so no late write can land in the decoder's cells) and the request
// falls back as a failed per-request provider does; the next request starts another.
//
// The region: the decoder sends its fds on every share; the provider is sent them only when
// the share is of another region than the one it holds (region_key: a re-export, a decoder
// restart) or the provider is a new one, and per request only the ids, n_cached and the
// share id. A provider that answers ESTALE (it holds no region, or another) is sent the
// region again and asked once more.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "kvshare/share/broker.h"
#include "kvshare/share/provider_protocol.h"
#include "layout/error.h"
#include "route/metrics.h"
#include "route/provider_run.h"
#include "route/resident_process.h"

namespace kvshare::route {

class ResidentProvider {
 public:
  struct Options {
    std::vector<std::string> argv;  // started by serve, the channel at fd 3 ("--serve-fd 3" included)
    std::string socket_path;        // instead: a provider listening here
    std::function<void(const std::string&)> log;
    Metrics* metrics = nullptr;
    // Bounds a model load on a busy machine, with room to spare: a hung provider, not a slow one.
    std::chrono::milliseconds hello_timeout{120000};
  };

  explicit ResidentProvider(Options options);

  // A provider runs and said hello (see ResidentProcess::ensure_running).
  Result<void> ensure_running();

  // What the running provider's hello said (false before any hello).
  bool takes_shared() const;
  bool takes_file() const;
  bool takes_cached() const;

  // Prefills `ids` into the decoder's region of `share`, cells n_cached.. (the region is sent
  // first when this provider does not hold it). The result reads as a per-request run's:
  // ok(), describe(), prefill_ms(); `started` false when no provider could be started or
  // reached (nothing was written), `failure` naming an error reply or a loss.
  ProviderRun prefill_shared(const ReceivedShare& share, std::span<const int32_t> ids, uint32_t n_cached,
                             std::chrono::milliseconds timeout);
  // Prefills `ids` into a state file at `state_path` (absolute) of `state_version` (0: the
  // provider's latest) with the decoder's KV params.
  ProviderRun prefill_file(std::span<const int32_t> ids, const std::string& state_path, uint32_t state_version,
                           const ProviderKvParams& kv, std::chrono::milliseconds timeout);

  pid_t pid() const { return process_.pid(); }
  unsigned long long restarts() const { return process_.restarts(); }
  // Regions sent so far (one per share generation per provider, plus ESTALE resends).
  unsigned long long regions_sent() const;

 private:
  // One request and its parsed reply; a reply that breaks the protocol loses the provider.
  Result<ProviderReply> ask(const ProviderRequest& request, std::span<const int> fds,
                            std::chrono::milliseconds timeout);
  Result<void> send_region(const ReceivedShare& share, const RegionKey& key, std::chrono::milliseconds timeout,
                           ProviderRun& run);
  ProviderRun prefill(const ProviderRequest& request, const ReceivedShare* share, std::chrono::milliseconds timeout);

  std::function<void(const std::string&)> log_;
  ResidentProcess process_;
  mutable std::mutex mutex_;
  ProviderReply hello_;  // the running provider's
  bool have_hello_ = false;
  // The region the provider of `region_incarnation_` holds.
  uint64_t region_incarnation_ = 0;
  RegionKey region_key_;
  uint64_t region_id_ = 0;
  uint64_t next_region_id_ = 0;
  unsigned long long regions_sent_ = 0;
};

// The argv serve starts a resident provider with: PROG --model M [--elfs DIR] --serve-fd 3.
std::vector<std::string> resident_provider_command(const std::string& program, const std::string& model,
                                                   const std::string& elfs_dir);

}  // namespace kvshare::route
