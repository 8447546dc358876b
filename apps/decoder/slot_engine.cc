#include "apps/decoder/slot_engine.h"

#include "kvshare/share/decoder_share.h"

namespace kvshare::decoder {

std::string SlotEngine::share_refusal() const {
  switch (share_availability()) {
    case ShareAvailability::enabled:
      return {};
    case ShareAvailability::flag_not_set:
      return share_unavailable_reason(false, "");
    case ShareAvailability::cannot_export:
      return share_unavailable_reason(true, "no export backend worked");
  }
  return {};
}

}  // namespace kvshare::decoder
