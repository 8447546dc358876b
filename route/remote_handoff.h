// The remote route (docs/remote.md), serve's side: the decoder shares the slot's cells with
// serve's resident receiver process (the ordinary share handshake, every check of the local
// shared route), the receiver grants the cells the slot does not hold to a prefill host's
// kvshare-provider-server, which prefills and writes them over UCX, and the decoder adopts
// them once the receiver found the provider's completion matching.
//
// With several prefill hosts (--prefill-remote, once each; route/prefill_hosts.h) a request
// tries them in PrefillHosts' order and goes to the next when one is at fault (no answer,
// busy, an error, a transfer the receiver refused): the slot is erased and shared again, so
// the next host writes every cell the first may have touched. A fault of the receiver or
// the decoder ends the route at once: no other host would fare better.
//
// Until a grant no peer can write, so such a failure takes the local route; from the grant
// on the cells may hold a peer's partial work, so every failure revokes the grant first (or
// kills the receiver, which ends every write with its mappings), then erases the slot.
#pragma once

#include <cstdint>
#include <functional>
#include <span>

#include "route/handoff.h"
#include "route/handoff_steps.h"

namespace kvshare::route {

StepResult remote_handoff(const HandoffContext& context, std::span<const int32_t> handoff_ids, uint64_t sequence,
                          HandoffReport& report);

// One try with one prefill host.
struct HostAttempt {
  StepResult result;
  bool host_at_fault = false;  // the host did not prefill (no answer, an error, a refused transfer): another may
  bool host_busy = false;      // it answered 503
};

// Asks the prefill hosts in PrefillHosts' order, `attempt(host, index)` once each, until one
// hands off or fails for a reason that is not the host's (then no other host would fare
// better), or the slot could not be erased. Each host's result goes to PrefillHosts and
// /metrics, and a host's fault with another host left is said ("trying URL") and counted.
// With `last_fault_takes_local_route`, the last host's own fault becomes take_file_route.
StepResult walk_prefill_hosts(const HandoffContext& context, HandoffReport& report,
                              const std::function<HostAttempt(size_t host, size_t index)>& attempt,
                              bool last_fault_takes_local_route);

}  // namespace kvshare::route
