#include "xdna/split_ceiling.h"

#include <gtest/gtest.h>

#include <cmath>

#include "support/test_support.h"

namespace kvshare::xdna {
namespace {

double rounded(double value) { return std::round(value * 1000.0) / 1000.0; }

TEST(SplitCeiling, ReproducesTheSeedsPreFixFigures) {
  // Seed page: a split GEMM speed-up of 1.164 over gemm shares 26.2 % .. 46.2 %.
  EXPECT_EQ(rounded(*end_to_end_factor(1.164, 0.262)), 1.038);
  EXPECT_EQ(rounded(*end_to_end_factor(1.164, 0.462)), 1.070);
}

TEST(SplitCeiling, ReproducesTheSeedsPostFixFigures) {
  EXPECT_EQ(rounded(*end_to_end_factor(1.033, 0.262)), 1.008);
  EXPECT_EQ(rounded(*end_to_end_factor(1.033, 0.462)), 1.015);
}

TEST(SplitCeiling, FinishesBothEnginesTogether) {
  // g = 0.01 ms/row; t = 7.68 ms/256 rows on 1 tile = 0.03 ms/row: m = gM/(g+r) = M/4.
  auto split = best_concurrent_split({0.01, 7.68, 1}, 4096);
  ASSERT_TRUE(split);
  EXPECT_EQ(split->npu_rows, 1024u);
  EXPECT_EQ(split->igpu_rows, 3072u);
  EXPECT_NEAR(split->speedup, 4.0 / 3.0, 1e-9);  // 1 + g/r
}

TEST(SplitCeiling, GivesMoreRowsToMoreTiles) {
  auto one = best_concurrent_split({0.01, 7.68, 1}, 4096);
  auto four = best_concurrent_split({0.01, 7.68, 4}, 4096);
  ASSERT_TRUE(one && four);
  EXPECT_GT(four->npu_rows, one->npu_rows);
  EXPECT_NEAR(four->speedup, 1.0 + 0.01 / (0.03 / 4), 1e-3);
}

TEST(SplitCeiling, SequentialOptimumIsNoProviderWhenItsRowsCostMore) {
  auto split = best_sequential_split({0.01, 7.68, 1}, 4096);  // provider row 0.03 > 0.01
  ASSERT_TRUE(split);
  EXPECT_EQ(split->provider_rows, 0u);
  EXPECT_DOUBLE_EQ(split->ms, split->decoder_alone_ms);
}

TEST(SplitCeiling, SequentialOptimumIsAllProviderWhenItsRowsCostLess) {
  auto split = best_sequential_split({0.05, 2.56, 1}, 100);  // provider row 0.01 < 0.05
  ASSERT_TRUE(split);
  EXPECT_EQ(split->provider_rows, 100u);
}

TEST(SplitCeiling, RefusesAShareGivenInPercent) {
  auto factor = end_to_end_factor(1.1, 26.2);
  ASSERT_FALSE(factor);
  EXPECT_NE(factor.error().message().find("--gemm-share 26.2 is not a fraction"), std::string::npos);
}

TEST(SplitCeiling, NamesTheFlagOfABadRate) {
  auto split = best_concurrent_split({0.0, 7.68, 1}, 10);
  ASSERT_FALSE(split);
  EXPECT_NE(split.error().message().find("--igpu-ms-per-row"), std::string::npos);
  EXPECT_FALSE(best_concurrent_split({0.01, 7.68, 0}, 10));
}

TEST(SplitCeilingTool, PrintsTheEndToEndFactorsForAGivenSpeedup) {
  auto result = kvshare::testing::run_command(kvshare::testing::tool_path("kvshare-split-ceiling").string() +
                                              " --speedup 1.164 --gemm-share 0.262 --gemm-share 0.462");
  ASSERT_EQ(result.exit_code, 0) << result.err;
  EXPECT_NE(result.out.find("gemm share 26.2 %: end-to-end 1.038x"), std::string::npos) << result.out;
  EXPECT_NE(result.out.find("gemm share 46.2 %: end-to-end 1.070x"), std::string::npos) << result.out;
}

TEST(SplitCeilingTool, ExitsWith2WithoutRatesOrSpeedup) {
  auto result =
      kvshare::testing::run_command(kvshare::testing::tool_path("kvshare-split-ceiling").string() + " --rows 100");
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_NE(result.err.find("--speedup"), std::string::npos);
}

}  // namespace
}  // namespace kvshare::xdna
