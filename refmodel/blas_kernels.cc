#include "refmodel/blas_kernels.h"

#include <cblas.h>
#include <strings.h>
#include <unistd.h>

#include <cstdlib>
#include <initializer_list>

namespace kvshare::refmodel {

const char* best_blas_core_for_this_cpu() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
  return nullptr;
}

bool blas_kernels_below_this_cpu() {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return false;
  if (best_blas_core_for_this_cpu() == nullptr) return false;
  const char* chosen = openblas_get_corename();
  if (chosen == nullptr) return false;
  // OpenBLAS's x86-64 cores with AVX2+FMA kernels; anything else is an older path.
  for (const char* modern : {"Haswell", "Zen", "SkylakeX", "Cooperlake", "SapphireRapids"})
    if (strcasecmp(chosen, modern) == 0) return false;
  return true;
}

void reexec_with_best_blas_kernels(char** argv) {
  if (!blas_kernels_below_this_cpu()) return;
  ::setenv("OPENBLAS_CORETYPE", best_blas_core_for_this_cpu(), 1);
  ::execv("/proc/self/exe", argv);
  // exec failed (no /proc?): go on with the kernels OpenBLAS chose.
  ::unsetenv("OPENBLAS_CORETYPE");
}

}  // namespace kvshare::refmodel
