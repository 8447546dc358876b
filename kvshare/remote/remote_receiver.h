// The decoder side of the remote route: the KV cache's chunks registered with UCX once at
// start, a UCX worker whose address goes out in every offer, and a progress thread that
// receives the provider's writes. Several grants may be open at once (one per slot: each
// its own stream, or its own run of cells of a unified cache), each with its own share_id
// and secret. Every write is checked before a byte lands against the grant its header
// names: the header must carry THAT grant's secret (compared in constant time), the grant
// must be open and before its deadline, and the byte range must lie inside its cells
// (layout::check_write); only then is the payload received, by ucp_am_recv_data_nbx, into
// the decoder's own pages. Anything else is refused (the sender's send fails with
// UCS_ERR_REJECTED) and logged; a write with a grant's secret that is refused spoils that
// grant only, one without it spoils nothing (a forger must not be able to deny the real
// provider's transfer, nor one provider another's).
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

// What a grant covers: a prompt of positions 0..n_cells-1 placed from `first_cell` of
// `stream`, of which the decoder holds positions 0..n_cached-1. The grant is cells
// first_cell + n_cached .. first_cell + n_cells - 1 (layout::grant_cells).
struct PromptCells {
  uint32_t stream = 0;
  uint32_t first_cell = 0;
  uint32_t n_cached = 0;
  uint32_t n_cells = 0;
};

class RemoteReceiver {
 public:
  // Registers each chunk (ucp_mem_map, once: not per tensor, not per share), creates the
  // worker and starts the progress thread. `chunks` are the decoder's KV chunks in fd
  // order, as `header.layout` places tensors in them; they must outlive the receiver.
  // ENOTSUP when kvshare was built without UCX; a UCX error naming the step otherwise.
  static Result<std::unique_ptr<RemoteReceiver>> start(const layout::ShareHeader& header,
                                                       std::vector<std::span<std::byte>> chunks, ReceiverLog log = {});
  ~RemoteReceiver();

  // Opens a grant of `cells` that lives `timeout`: first revokes every open grant whose
  // cells overlap the prompt's cells [first_cell, first_cell + n_cells) of the same stream
  // (the slot's earlier grant: its peer must not land bytes in cells the decoder now reads
  // or re-grants), waiting for their receives; other grants stay open. Draws a random
  // grant id (the offer's share_id) and a 128-bit secret (getrandom) and returns the offer
  // (version 3), which carries both. EINVAL/ERANGE when the layout cannot grant the cells
  // (layout::grant_cells names the field).
  Result<RemoteOffer> grant(const PromptCells& cells, std::chrono::milliseconds timeout = kDefaultGrantTimeout);

  // The adopt check of grant `grant_id`: it was granted and not replaced (ESTALE), is open
  // (ESTALE naming its state), its deadline has not passed (ETIMEDOUT), no write was
  // refused and no receive failed (EIO naming the first fault), the provider's completion
  // arrived (EIO: "partial transfer", with the bytes received) with this grant's id,
  // n_tokens (the prompt's positions, n_cached < n_tokens <= n_cells: ERANGE), the layout
  // hash and the byte count received, which is what cells first_cell + n_cached ..
  // first_cell + n_tokens - 1 take (EIO naming both). Success closes the grant to writes;
  // any failure revokes it. Blocks at most as long as revoke(). Other grants are untouched.
  // Returns the bytes received (what the adopted cells take).
  Result<uint64_t> complete(uint64_t grant_id, uint32_t n_tokens);

  // Stops accepting writes for grant `grant_id` (if it is open) and waits until none of its
  // receives is in flight (at most 5 s, once per grant, then says so on the log). Other
  // grants stay open. An unknown id is a no-op.
  void revoke(uint64_t grant_id, std::string_view why);
  // revoke() of every grant: the owner revokes first, before anything may touch any cell.
  // Cheap when none is open.
  void revoke_all(std::string_view why);

  // Whether `grant_id` is a grant this receiver holds (open or closed, not yet replaced).
  bool issued(uint64_t grant_id) const;
  // How many grants are open (accepting writes).
  size_t open_grants() const;
  ReceiverCounters counters() const;

 private:
  struct Impl;
  explicit RemoteReceiver(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvshare::remote
