// Links the installed kvshare and uses one symbol of each public library.
#include <cstdio>

#include "kvshare/fd.h"
#include "layout/tensor_type.h"

int main() {
  kvshare::Fd fd;  // empty: -1
  const auto row = kvshare::layout::ggml_row_size(kvshare::layout::GgmlType::F16, 128);
  if (fd.valid() || row != 256) {
    std::fprintf(stderr, "kvshare-consumer: unexpected values from the installed library\n");
    return 1;
  }
  std::printf("kvshare-consumer: linked the installed kvshare (f16 row of 128 = %llu bytes)\n",
              static_cast<unsigned long long>(row));
  return 0;
}
