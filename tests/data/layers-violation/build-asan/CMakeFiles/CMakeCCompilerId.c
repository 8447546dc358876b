/* CMake compiler-id source in a build tree: not a product source. */
#include "route/serve.h"
