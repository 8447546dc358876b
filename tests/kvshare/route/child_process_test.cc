#include "kvshare/route/child_process.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <fstream>

#include "kvshare/route/provider_run.h"
#include "support/test_support.h"

namespace kvshare::route {
namespace {

using kvshare::testing::TempDir;

class ChildProcessTest : public kvshare::testing::FdLeakCheck {};

TEST_F(ChildProcessTest, CapturesStdoutAndTheExitCode) {
  auto child = ChildProcess::spawn({"/bin/sh", "-c", "echo hello; exit 3"}, SpawnOptions{.capture_stdout = true});
  ASSERT_TRUE(child) << child.error().what();
  auto finished = child->wait_for(std::chrono::seconds(20));
  ASSERT_TRUE(finished) << finished.error().what();
  EXPECT_EQ(finished->out, "hello\n");
  EXPECT_TRUE(finished->status.exited);
  EXPECT_EQ(finished->status.code, 3);
  EXPECT_EQ(finished->status.describe(), "exit code 3");
}

TEST_F(ChildProcessTest, ReportsAProgramThatCannotStart) {
  auto child = ChildProcess::spawn({"/nonexistent/provider"}, SpawnOptions{});
  ASSERT_FALSE(child);
  EXPECT_EQ(child.error().errno_value(), ENOENT);
  EXPECT_NE(child.error().message().find("/nonexistent/provider"), std::string::npos);
}

TEST_F(ChildProcessTest, InheritsOnlyTheDescriptorsItIsGivenAtTheirNumbers) {
  TempDir dir;
  const auto data = dir / "data";
  std::ofstream(data) << "payload";
  const int fd = ::open(data.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  const int stray = ::open(data.c_str(), O_RDONLY | O_CLOEXEC);  // close-on-exec: must stay behind
  ASSERT_GE(stray, 0);
  SpawnOptions options;
  options.capture_stdout = true;
  options.inherit_fds = {{fd, 7}};
  auto child = ChildProcess::spawn({"/bin/sh", "-c", "cat <&7; ls /proc/self/fd | sort -n | tr '\\n' ' '"}, options);
  ::close(fd);
  ::close(stray);
  ASSERT_TRUE(child) << child.error().what();
  auto finished = child->wait_for(std::chrono::seconds(20));
  ASSERT_TRUE(finished);
  // 0-2, 7, and the one ls itself opens to list the directory.
  EXPECT_EQ(finished->out.substr(0, 7), "payload");
  EXPECT_NE(finished->out.find(" 7 "), std::string::npos) << finished->out;
  EXPECT_EQ(finished->out.find(" " + std::to_string(stray) + " "), std::string::npos) << finished->out;
}

TEST_F(ChildProcessTest, TimeoutKillsTheProviderAndItsWholeProcessGroup) {
  TempDir dir;
  const auto pid_file = dir / "grandchild.pid";
  const ProviderRun run = run_provider(
      {"/bin/sh", "-c", "sleep 30 & echo $! > " + pid_file.string() + "; wait"}, {}, std::chrono::milliseconds(500));
  EXPECT_TRUE(run.started);
  EXPECT_TRUE(run.timed_out);
  EXPECT_FALSE(run.ok());
  EXPECT_NE(run.describe().find("timed out"), std::string::npos);
  pid_t grandchild = 0;
  std::ifstream(pid_file) >> grandchild;
  ASSERT_GT(grandchild, 0);
  // Killed with the group; it may linger a moment as our zombie's sibling being reaped by init.
  bool gone = false;
  for (int i = 0; i < 200 && !gone; ++i) {
    std::ifstream stat("/proc/" + std::to_string(grandchild) + "/stat");
    std::string line;
    gone = !std::getline(stat, line) || line.find(") Z") != std::string::npos;
    if (!gone) usleep(10000);
  }
  EXPECT_TRUE(gone) << "grandchild " << grandchild << " survived the timeout";
}

TEST_F(ChildProcessTest, ProviderRunTakesThePrefillMsFromTheLastStdoutLine) {
  const ProviderRun run =
      run_provider({"/bin/sh", "-c", "echo working; echo '{\"prefill_ms\": 41.5}'"}, {}, std::chrono::seconds(20));
  ASSERT_TRUE(run.ok()) << run.describe();
  EXPECT_EQ(run.reported_prefill_ms, 41.5);
  EXPECT_EQ(run.prefill_ms(), 41.5);
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
