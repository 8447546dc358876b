#include "kvshare/route/share_session.h"

namespace kvshare::route {

// The zerocopy broker (kvshare/share) is not in this tree yet: no shared route, and the
// router takes the state-file route for every request.
std::unique_ptr<ShareBroker> make_kvshare_broker() { return nullptr; }

}  // namespace kvshare::route
