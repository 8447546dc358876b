// Allowed: its own layer.
#include "layout/other.h"
