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
    case ShareAvailability::flag_not_set:
      // The caller cannot tell which cause applies from outside: name both.
      return "this decoder cannot share its KV cache: either ONEBIT_KV_SHARE was not set when it started (it was "
             "not: set it to any non-empty value), or its KV backend cannot export its memory";
    case ShareAvailability::cannot_export: return share_unavailable_reason(true, "no export backend worked");
  }
  return {};
}

}  // namespace kvshare::decoder
