// Making sure OpenBLAS runs the kernels this CPU can run. Debian 12's OpenBLAS (0.3.21)
// picks its kernels by CPU model number, and on a CPU model newer than it knows it falls
// back to its Prescott (SSE3) kernels even when the CPU has AVX-512: on the CI VM's Xeon
// that made the reference prefill several times slower (docs/refmodel.md, "Performance",
// has the kernels measured side by side).
#pragma once

namespace kvshare::refmodel {

// The OpenBLAS core type to ask for on this CPU ("SkylakeX" with AVX-512 F/BW/VL/DQ,
// "Haswell" with AVX2 and FMA), or nullptr when the CPU has neither.
const char* best_blas_core_for_this_cpu();

// True when OpenBLAS chose kernels older than `best_blas_core_for_this_cpu()` (its
// Prescott, Core2, Nehalem, Sandybridge... paths) and OPENBLAS_CORETYPE is not set.
bool blas_kernels_below_this_cpu();

// Called first thing in main() by the tools that run BLAS (kvshare-prefill,
// kvshare-decoder): when blas_kernels_below_this_cpu(), sets OPENBLAS_CORETYPE to the best
// core and re-executes the program with the same argv, environment and inherited
// descriptors (OpenBLAS reads the variable only when it loads). At most once: the
// variable is set the second time. An explicit OPENBLAS_CORETYPE is always left alone.
void reexec_with_best_blas_kernels(char** argv);

}  // namespace kvshare::refmodel
