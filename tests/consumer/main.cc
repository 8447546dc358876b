// Links the installed kvshare (the C API) from C++17 and calls it.
#include <cstdio>

#include "kvshare.h"

int main() {
  kvshare_kv_params params{};
  kvshare_kv_params_init(&params);
  if (params.struct_size != sizeof params || params.n_ctx != 4096 || params.n_seq_max != 1) {
    std::fprintf(stderr, "kvshare-consumer: kvshare_kv_params_init gave struct_size %u, n_ctx %u, n_seq_max %u\n",
                 params.struct_size, params.n_ctx, params.n_seq_max);
    return 1;
  }
  std::printf("kvshare-consumer: linked the installed libkvshare_c (llama-server's defaults: n_ctx %u)\n",
              params.n_ctx);
  return 0;
}
