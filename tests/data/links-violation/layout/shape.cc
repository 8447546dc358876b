#include "layout/shape.h"
int shape_rows() { return 1; }
