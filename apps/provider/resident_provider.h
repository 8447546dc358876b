// kvshare-prefill --serve PATH / --serve-fd N: the reference provider in its resident form
// (issue 24). It loads the model once and keeps the decoder's region mapped (and faulted
// in) across requests, answering kvshare-serve's region and prefill requests
// (kvshare/share/provider_protocol.h; docs/provider.md, "The resident provider"). The
// prefills are the per-request form's (prefill_routes.h), so both give the same bytes.
//
// Lifetime of the region: mapped at a region request, after the previous one was unmapped;
// written only while a prefill of its region_id runs; unmapped at the next region request
// or when the channel closes. The decoder keeps its region whatever we do with our mapping.
// The provider's own cache and the Context over it (PrivateContext) outlive requests,
// regions and channels: made at the first prefill, made again only for a longer prompt or
// other KV types.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>

#include "apps/provider/prefill_routes.h"
#include "kvshare/region/importer.h"
#include "kvshare/share/provider_channel.h"
#include "kvshare/share/provider_share.h"
#include "layout/error.h"
#include "layout/share_header.h"

namespace kvshare::refmodel {

struct ResidentOptions {
  std::string model_path;
  std::filesystem::path socket_path;  // --serve PATH: listen there, one serve at a time
  int serve_fd = -1;                  // --serve-fd N: serve's end of a socket pair (taken)
  int n_threads = 0;                  // 0: all cores
  std::string elfs_dir;               // accepted for the contract and ignored, as per request
};

// How serving one channel ended.
enum class ChannelEnd {
  closed,   // serve closed the channel between requests (ENODATA)
  stopped,  // `stop_requested` held between requests
};

// One loaded model, serving channels one after the other.
class ResidentProvider {
 public:
  ResidentProvider(ProviderModel model, int n_threads) : model_(std::move(model)), n_threads_(n_threads) {}

  // Says hello (routes shared and file, cached, our pid), then answers `channel`'s requests
  // one at a time. A request that fails (a region of another model, a stale region_id, an
  // id outside the vocabulary, a state file that cannot be written) is a reply with ok
  // false, its errno and message, and serving goes on; only a channel failure (a frame that
  // breaks the protocol, a reply that cannot be sent) is an Error. Between requests it
  // calls `stop_requested` (when set) about every 100 ms. Drops the region before it returns.
  // Writes one line per request to stderr.
  Result<ChannelEnd> serve(ProviderChannel& channel, const std::function<bool()>& stop_requested = {});

 private:
  struct HeldRegion {
    uint64_t region_id = 0;
    ProviderShare share;  // the decoder's header, checked against the model; our mapping, faulted in
  };

  ProviderReply map_region(ProviderCall& call, const std::string& who);
  ProviderReply prefill(const ProviderRequest& request);
  Result<PrefillReport> prefill_shared(const ProviderRequest& request);
  Result<PrefillReport> prefill_file(const ProviderRequest& request);

  ProviderModel model_;
  int n_threads_ = 0;
  std::optional<HeldRegion> region_;
  // Both routes' private cache and Context, kept across requests and channels while the
  // KV types stay the same: no cache to fault in and no attention scratch to unmap per
  // prompt (private_kv.h). It keeps the longest prompt's working memory.
  PrivateContext own_;
};

// kvshare-prefill's resident main: loads the model, then serves --serve-fd's channel until
// serve closes it, or listens at --serve PATH and serves each serve that connects, one at
// a time, until SIGINT or SIGTERM (install_stop_signals: call from the main thread before
// any other thread starts). Returns the exit status: 0 on serve's close or a stop signal,
// 1 when the model does not load or a channel fails (the message on stderr, prefixed
// "kvshare-prefill: ").
int run_resident_provider(const ResidentOptions& options);

}  // namespace kvshare::refmodel
