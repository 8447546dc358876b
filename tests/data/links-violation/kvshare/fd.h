// A public header that includes layout/, while kvshare links layout PRIVATE only.
#pragma once
#include "layout/shape.h"
int fd_rows();
