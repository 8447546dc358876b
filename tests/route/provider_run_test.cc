#include "route/provider_run.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <fstream>

#include "support/test_support.h"

namespace kvshare::route {
namespace {

using kvshare::testing::TempDir;

class ProviderRunTest : public kvshare::testing::FdLeakCheck {};

TEST_F(ProviderRunTest, TimeoutKillsTheProviderAndItsWholeProcessGroup) {
  TempDir dir;
  const auto pid_file = dir / "grandchild.pid";
  const ProviderRun run = run_provider(
      {"/bin/sh", "-c", kvshare::testing::sleep_past_deadline() + " & echo $! > " + pid_file.string() + "; wait"}, {},
      std::chrono::milliseconds(500));
  EXPECT_TRUE(run.started);
  EXPECT_TRUE(run.timed_out);
  EXPECT_FALSE(run.ok());
  EXPECT_NE(run.describe().find("timed out"), std::string::npos);
  pid_t grandchild = 0;
  std::ifstream(pid_file) >> grandchild;
  ASSERT_GT(grandchild, 0);
  // Killed with the group; it may linger a moment as our zombie's sibling being reaped by init.
  const bool gone = kvshare::testing::wait_until([&] {
    std::ifstream stat("/proc/" + std::to_string(grandchild) + "/stat");
    std::string line;
    return !std::getline(stat, line) || line.find(") Z") != std::string::npos;
  });
  EXPECT_TRUE(gone) << "grandchild " << grandchild << " survived the timeout";
}

TEST_F(ProviderRunTest, ProviderRunTakesThePrefillMsFromTheLastStdoutLine) {
  const ProviderRun run =
      run_provider({"/bin/sh", "-c", "echo working; echo '{\"prefill_ms\": 41.5}'"}, {}, std::chrono::seconds(20));
  ASSERT_TRUE(run.ok()) << run.describe();
  EXPECT_EQ(run.reported_prefill_ms, 41.5);
  EXPECT_EQ(run.prefill_ms(), 41.5);
}

TEST_F(ProviderRunTest, SaysAProviderThatCouldNotStartWasNeverStarted) {
  const ProviderRun run = run_provider({"/nonexistent/provider"}, {}, std::chrono::seconds(5));
  EXPECT_FALSE(run.started);
  EXPECT_EQ(run.describe().rfind("could not start: ", 0), 0u) << run.describe();
  EXPECT_NE(run.describe().find("/nonexistent/provider"), std::string::npos);
}

TEST_F(ProviderRunTest, KeepsTheProvidersStderrForServesLog) {
  const ProviderRun run = run_provider({"/bin/sh", "-c", "echo 'no model' >&2; exit 2"}, {}, std::chrono::seconds(20));
  EXPECT_EQ(run.describe(), "exit code 2");
  EXPECT_EQ(run.err, "no model\n");
}

TEST(ReportedPrefillMs, IgnoresAnythingButAJsonObjectWithANumber) {
  EXPECT_EQ(reported_prefill_ms("{\"prefill_ms\": 3}\n\n"), 3.0);
  EXPECT_EQ(reported_prefill_ms("{\"prefill_ms\": 3}\nlater line\n"), std::nullopt);
  EXPECT_EQ(reported_prefill_ms("{\"prefill_ms\": \"3\"}"), std::nullopt);
  EXPECT_EQ(reported_prefill_ms("{\"prefill_ms\": -1}"), std::nullopt);
  EXPECT_EQ(reported_prefill_ms(""), std::nullopt);
}

}  // namespace
}  // namespace kvshare::route
