// A lower layer reaching up: kvshare/ may not include the route.
#include "layout/shape.h"
#include "route/serve.h"
