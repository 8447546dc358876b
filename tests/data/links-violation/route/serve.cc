// Includes kvshare/ only, while the route also links layout.
#include "route/serve.h"
#include "kvshare/fd.h"
int serve() { return fd_rows(); }
