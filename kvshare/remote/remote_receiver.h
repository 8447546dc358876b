// The decoder side of the remote route: the KV cache's chunks registered with UCX once at
// start, a UCX worker whose address goes out in every offer, and a progress thread that
// receives the provider's writes. Every write is checked before a byte lands: its header
// must carry the open share's secret (compared in constant time, first), name the open
// share (share_id), arrive before its deadline, and give a byte range inside the granted
// cells (layout::check_write); only then is its payload received, by
// ucp_am_recv_data_nbx, into the decoder's own pages. Anything else is refused (the
// sender's send fails with UCS_ERR_REJECTED) and logged; a write with the right secret
// that is refused spoils the open share, one without it does not (a forger must not be
// able to deny the real provider's transfer).
//
// Lifetime: between grant() and complete()/revoke() the provider may write the granted
// cells and the decoder must not touch them. revoke() (and a failed complete()) stops
// accepting writes first and then waits until no receive is in flight, so cells are
// never reused while a peer can still land bytes in them (the owner revokes first).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvshare/remote/remote_offer.h"
#include "layout/error.h"
#include "layout/share_header.h"

namespace kvshare::remote {

inline constexpr std::chrono::milliseconds kDefaultGrantTimeout{120000};

struct ReceiverCounters {
  uint64_t writes_accepted = 0;
  uint64_t writes_refused = 0;
  uint64_t bytes_accepted = 0;
  std::string last_refusal;  // the message of the latest refused write or completion
};

// One line for stderr (the decoder prefixes nothing: the text names the share).
using ReceiverLog = std::function<void(const std::string& line)>;

class RemoteReceiver {
 public:
  // Registers each chunk (ucp_mem_map, once: not per tensor, not per share), creates the
  // worker and starts the progress thread. `chunks` are the decoder's KV chunks in fd
  // order, as `header.layout` places tensors in them; they must outlive the receiver.
  // ENOTSUP when kvshare was built without UCX; a UCX error naming the step otherwise.
  static Result<std::unique_ptr<RemoteReceiver>> start(const layout::ShareHeader& header,
                                                       std::vector<std::span<std::byte>> chunks, ReceiverLog log = {});
  ~RemoteReceiver();

  // Opens a new share of cells 0..n_cells-1 that lives `timeout`: revokes the earlier one
  // first (waiting for its receives), draws a random share_id and a 128-bit secret
  // (getrandom), and returns the offer, which carries both.
  // ERANGE/EINVAL when the layout cannot grant n_cells (layout::check_grant).
  Result<RemoteOffer> grant(uint32_t n_cells, std::chrono::milliseconds timeout = kDefaultGrantTimeout);

  // The adopt check: the share is the open one (ESTALE), its deadline has not passed
  // (ETIMEDOUT), no write was refused and no receive failed (EIO naming the first
  // fault), the provider's completion arrived (EIO: "partial transfer", with the bytes
  // received) with this share_id, n_tokens, the layout hash and the byte count received,
  // which is what n_tokens cells take (EIO naming both). Success closes the share to
  // writes; any failure revokes it. Blocks at most as long as revoke().
  Result<void> complete(uint64_t share_id, uint32_t n_tokens);

  // Stops accepting writes for the open share (if any) and waits until none is in flight
  // (at most 5 s, once per share, then says so on the log). Cheap when no share is open: the decoder
  // calls it before any evaluation or restore touches the cells.
  void revoke(std::string_view why);

  // Whether `share_id` is the latest share this receiver granted (open or not).
  bool issued(uint64_t share_id) const;
  ReceiverCounters counters() const;

 private:
  struct Impl;
  explicit RemoteReceiver(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvshare::remote
