#include "kvshare/fd.h"
int fd_rows() { return shape_rows(); }
