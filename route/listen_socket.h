// serve's listening socket. cpp-httplib creates, binds and listens on it; serve then makes
// it what serve promises, and starts only if both steps succeed:
//   - SO_REUSEADDR and not httplib's default SO_REUSEPORT, so no second server can bind
//     beside it and take half of its clients;
//   - a backlog of SOMAXCONN instead of httplib's 5: a burst of clients overflows 5 and,
//     with SYN cookies, the kernel answers the overflow with resets.
#pragma once

#include "layout/error.h"

namespace kvshare::route {

// Sets SO_REUSEADDR on `fd` (borrowed; httplib's socket options hook, before the bind).
// Fails with setsockopt's errno, naming the fd.
Result<void> reuse_address(int fd);
// Listens again on `fd` (borrowed, already listening) with a backlog of SOMAXCONN; the
// kernel takes the new backlog. Fails with listen's errno, naming the fd.
Result<void> deepen_backlog(int fd);

}  // namespace kvshare::route
