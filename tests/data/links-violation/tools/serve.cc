// Includes kvshare/, which the tool does not link: it would build through the route.
#include "kvshare/fd.h"
#include "route/serve.h"
int main() { return serve() + fd_rows(); }
