// The BLAS-running tools use OpenBLAS kernels that match the CPU, also where Debian's
// OpenBLAS does not know the CPU model and falls back to Prescott (refmodel/blas_kernels.h).
#include "refmodel/blas_kernels.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "support/test_support.h"

namespace kvshare {
namespace {

// The last "Core: X" line OpenBLAS prints at load with OPENBLAS_VERBOSE=2.
std::string last_core_line(const std::string& err) {
  const auto at = err.rfind("Core: ");
  if (at == std::string::npos) return "";
  return err.substr(at + 6, err.find('\n', at) - at - 6);
}

TEST(BlasKernels, ToolsRunKernelsThisCpuCanRun) {
  const char* best = refmodel::best_blas_core_for_this_cpu();
  if (best == nullptr) GTEST_SKIP() << "this CPU has neither AVX2+FMA nor AVX-512: OpenBLAS's choice stands";
  for (const char* tool : {"kvshare-prefill", "kvshare-decoder"}) {
    const auto result = testing::run_command("env -u OPENBLAS_CORETYPE OPENBLAS_VERBOSE=2 " +
                                             testing::tool_path(tool).string() + " --help");
    ASSERT_EQ(result.exit_code, 0) << tool << ": " << result.err;
    const std::string core = last_core_line(result.err);
    ASSERT_FALSE(core.empty()) << tool << " printed no OpenBLAS core line:\n" << result.err;
    for (const char* old : {"Prescott", "Core2", "Penryn", "Dunnington", "Nehalem", "Sandybridge", "Atom"})
      EXPECT_NE(core, old) << tool << " runs OpenBLAS's " << core << " kernels on a CPU fit for " << best;
  }
}

TEST(BlasKernels, LeavesAnExplicitCoreTypeAlone) {
  ::setenv("OPENBLAS_CORETYPE", "Prescott", 1);
  EXPECT_FALSE(refmodel::blas_kernels_below_this_cpu());
  ::unsetenv("OPENBLAS_CORETYPE");
  const auto result = testing::run_command("env OPENBLAS_CORETYPE=Prescott OPENBLAS_VERBOSE=2 " +
                                           testing::tool_path("kvshare-prefill").string() + " --help");
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_EQ(last_core_line(result.err), "Prescott") << result.err;
}

}  // namespace
}  // namespace kvshare
