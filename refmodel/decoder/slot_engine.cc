#include "refmodel/decoder/slot_engine.h"

#include "kvshare/share/decoder_share.h"

namespace kvshare::decoder {

Result<remote::RemoteOffer> SlotEngine::share_remote(uint32_t) {
  return fail(ENOTSUP, "this decoder has no remote route (start it with KVSHARE_REMOTE=ucx, built with UCX)");
}

void SlotEngine::revoke_remote(std::string_view) {}

bool SlotEngine::is_remote_share(uint64_t) const { return false; }

std::string SlotEngine::share_refusal() const {
  switch (share_availability()) {
    case ShareAvailability::enabled: return {};
    case ShareAvailability::flag_not_set: return share_unavailable_reason(false, "");
    case ShareAvailability::cannot_export: return share_unavailable_reason(true, "no export backend worked");
  }
  return {};
}

}  // namespace kvshare::decoder
