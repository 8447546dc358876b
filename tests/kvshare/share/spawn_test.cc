#include "kvshare/share/spawn.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

#include "kvshare/fd.h"
#include "kvshare/share/broker.h"
#include "support/test_support.h"

namespace kvshare {
namespace {

using testing::FdLeakCheck;

class ChildProcess : public FdLeakCheck {};

TEST_F(ChildProcess, InheritsExactlyTheToldDescriptorsAtThreeOnwards) {
  Fd a(::memfd_create("spawn-a", MFD_CLOEXEC)), b(::memfd_create("spawn-b", MFD_CLOEXEC));
  const int fds[] = {b.get(), a.get()};
  auto result = run_child({"/bin/sh", "-c", "ls /proc/self/fd; readlink /proc/self/fd/3 /proc/self/fd/4"}, fds, 5000);
  ASSERT_TRUE(result) << result.error().what();
  ASSERT_EQ(result->exit_code, 0) << result->stderr_text;
  // 0-2 are the standard streams, 3 and 4 the told fds, 5 the directory ls itself opens.
  EXPECT_EQ(result->stdout_text.rfind("0\n1\n2\n3\n4\n5\n/memfd:", 0), 0u) << result->stdout_text;
  EXPECT_NE(result->stdout_text.find("/memfd:spawn-b"), std::string::npos);
  EXPECT_LT(result->stdout_text.find("/memfd:spawn-b"), result->stdout_text.find("/memfd:spawn-a"));
}

TEST_F(ChildProcess, CapturesTheLastStdoutLineAndStderr) {
  auto result = run_child({"/bin/sh", "-c", "echo one; echo two; echo oops >&2; exit 4"}, {}, 5000);
  ASSERT_TRUE(result) << result.error().what();
  EXPECT_EQ(result->exit_code, 4);
  EXPECT_EQ(result->last_stdout_line(), "two");
  EXPECT_EQ(result->stderr_text, "oops\n");
}

TEST_F(ChildProcess, KillsTheProcessGroupAtTheDeadline) {
  auto result = run_child({"/bin/sh", "-c", "sleep 30 & sleep 30"}, {}, 200);
  ASSERT_TRUE(result) << result.error().what();
  EXPECT_TRUE(result->timed_out);
  EXPECT_LT(result->elapsed_ms, 5000);
}

TEST_F(ChildProcess, NamesAProgramThatCannotStart) {
  testing::TempDir dir;
  auto result = run_child({(dir / "no-such-provider").string()}, {}, 1000);
  ASSERT_FALSE(result);
  EXPECT_EQ(result.error().errno_value(), ENOENT);
  EXPECT_NE(result.error().message().find("no-such-provider"), std::string::npos);
}

TEST(ProviderArgv, SubstitutesLayoutAndFds) {
  std::vector<handshake::FdEntry> entries(2);
  auto argv = expand_provider_argv({"prov", "--layout", "{layout}", "--fds", "{fds}"}, "/d/layout-1.json", entries);
  ASSERT_TRUE(argv) << argv.error().what();
  EXPECT_EQ(*argv, (std::vector<std::string>{"prov", "--layout", "/d/layout-1.json", "--fds", "3,4"}));
}

TEST(ProviderArgv, RefusesATemplateWithoutThePlaceholders) {
  std::vector<handshake::FdEntry> entries(1);
  auto argv = expand_provider_argv({"prov", "--layout", "{layout}"}, "x", entries);
  ASSERT_FALSE(argv);
  EXPECT_NE(argv.error().message().find("{layout} and {fds}"), std::string::npos) << argv.error().message();
}

TEST(ProviderArgv, RefusesNonZeroOffsetsWithoutAPlaceFromThem) {
  std::vector<handshake::FdEntry> entries(1);
  entries[0].offset = 4096;
  auto argv = expand_provider_argv({"prov", "--layout", "{layout}", "--fds", "{fds}"}, "x", entries);
  ASSERT_FALSE(argv);
  EXPECT_NE(argv.error().message().find("{fd_offsets}"), std::string::npos);
}

}  // namespace
}  // namespace kvshare
