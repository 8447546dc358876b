#include "kvshare/share/spawn.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <utility>
#include <vector>

#include "kvshare/fd.h"
#include "kvshare/share/broker.h"
#include "kvshare/sys.h"
#include "support/test_support.h"

namespace kvshare {
namespace {

using testing::FdLeakCheck;

class Spawn : public FdLeakCheck {};

Finished run(const std::vector<std::string>& argv, SpawnOptions options = {},
             std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  options.capture_stdout = true;
  options.capture_stderr = true;
  auto finished = run_child(argv, options, timeout);
  EXPECT_TRUE(finished) << finished.error().what();
  return finished ? std::move(*finished) : Finished{};
}

bool process_gone(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  return !std::getline(stat, line) || line.find(") Z") != std::string::npos;
}

// Whether `pid` has a handler installed for `sig` (its SigCgt mask in /proc/<pid>/status).
bool catches_signal(pid_t pid, int sig) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("SigCgt:", 0) == 0) return (std::stoull(line.substr(7), nullptr, 16) >> (sig - 1)) & 1;
  }
  return false;
}

// The pid a shell wrote to `path` with `echo $! > path`, once the whole line is there; -1
// if it never came.
pid_t wait_for_pid_file(const std::filesystem::path& path) {
  std::string text;
  const bool written = testing::wait_until([&] {
    std::ifstream file(path);
    text.assign(std::istreambuf_iterator<char>(file), {});
    return !text.empty() && text.back() == '\n';
  });
  return written ? std::stoi(text) : -1;
}

TEST_F(Spawn, InheritsExactlyTheToldDescriptorsAtThreeOnwards) {
  Fd a(::memfd_create("spawn-a", MFD_CLOEXEC)), b(::memfd_create("spawn-b", MFD_CLOEXEC));
  const int fds[] = {b.get(), a.get()};
  SpawnOptions options;
  options.inherit_fds = inherit_in_order(fds);
  const auto result = run({"/bin/sh", "-c", "ls /proc/self/fd; readlink /proc/self/fd/3 /proc/self/fd/4"}, options);
  ASSERT_TRUE(result.status.ok()) << result.err;
  // 0-2 are the standard streams, 3 and 4 the told fds, 5 the directory ls itself opens.
  EXPECT_EQ(result.out.rfind("0\n1\n2\n3\n4\n5\n/memfd:", 0), 0u) << result.out;
  EXPECT_LT(result.out.find("/memfd:spawn-b"), result.out.find("/memfd:spawn-a"));
}

// Regression: the route's spawner relied on close-on-exec, and cpp-httplib accepts client
// sockets without SOCK_CLOEXEC, so every file-route provider inherited other clients' sockets.
TEST_F(Spawn, PassesNoOtherDescriptorEvenOneWithoutCloseOnExec) {
  Fd stray(::socket(AF_INET, SOCK_STREAM, 0));  // no SOCK_CLOEXEC, as httplib's accept()
  ASSERT_TRUE(stray);
  Fd told(::memfd_create("spawn-told", MFD_CLOEXEC));
  SpawnOptions options;
  options.inherit_fds = {{told.get(), 9}};
  const auto result = run({"/bin/sh", "-c", "ls /proc/self/fd | tr '\\n' ' '"}, options);
  ASSERT_TRUE(result.status.ok()) << result.err;
  // 0-2, 9, and the one ls itself opens (3, the lowest free number).
  EXPECT_EQ(result.out, "0 1 2 3 9 ") << "stray socket was fd " << stray.get();
}

// Regression: the route's spawner had room for 64 inherited descriptors, the broker's for 253.
TEST_F(Spawn, PassesTwoHundredFiftyThreeDescriptors) {
  std::vector<Fd> owned;
  std::vector<int> fds;
  for (int i = 0; i < 253; ++i) {
    owned.emplace_back(::memfd_create("spawn-many", MFD_CLOEXEC));
    fds.push_back(owned.back().get());
  }
  SpawnOptions options;
  options.inherit_fds = inherit_in_order(fds);
  const auto result = run({"/bin/sh", "-c", "ls /proc/self/fd | wc -l"}, options);
  ASSERT_TRUE(result.status.ok()) << result.err;
  EXPECT_EQ(result.out, "257\n");  // 0-2, 253 told, and ls's own
}

// The file actions run in order: a source sitting on another's target number must be read
// before that dup2 clobbers it. Here each source sits on the other's target.
TEST_F(Spawn, PassesTwoDescriptorsThatSitOnEachOthersTargetNumbers) {
  Fd a(::memfd_create("spawn-a", MFD_CLOEXEC)), b(::memfd_create("spawn-b", MFD_CLOEXEC));
  SpawnOptions options;
  options.inherit_fds = {{a.get(), b.get()}, {b.get(), a.get()}};
  const std::string script = fmt::format("readlink /proc/self/fd/{} /proc/self/fd/{}", b.get(), a.get());
  const auto result = run({"/bin/sh", "-c", script}, options);
  ASSERT_TRUE(result.status.ok()) << result.err;
  EXPECT_EQ(result.out.rfind("/memfd:spawn-a"), 0u) << "fd " << b.get() << " should be a: " << result.out;
  EXPECT_NE(result.out.find("\n/memfd:spawn-b"), std::string::npos) << "fd " << a.get() << " should be b";
}

TEST_F(Spawn, RefusesAnInheritListThatWouldOverwriteTheStandardStreamsOrRepeatANumber) {
  Fd a(::memfd_create("spawn-a", MFD_CLOEXEC));
  auto low = ChildProcess::spawn({"/bin/true"}, SpawnOptions{.inherit_fds = {{a.get(), 2}}});
  ASSERT_FALSE(low);
  EXPECT_EQ(low.error().errno_value(), EINVAL);
  EXPECT_NE(low.error().message().find("number 2"), std::string::npos) << low.error().message();
  auto twice = ChildProcess::spawn({"/bin/true"}, SpawnOptions{.inherit_fds = {{a.get(), 5}, {a.get(), 5}}});
  ASSERT_FALSE(twice);
  EXPECT_NE(twice.error().message().find("two inherited descriptors want number 5"), std::string::npos);
}

TEST_F(Spawn, NamesTheDescriptorADup2FailedOn) {
  auto child = ChildProcess::spawn({"/bin/true"}, SpawnOptions{.inherit_fds = {{987, 3}}});  // 987 is not open
  ASSERT_FALSE(child);
  EXPECT_EQ(child.error().errno_value(), EBADF);
  EXPECT_NE(child.error().message().find("fd 987"), std::string::npos) << child.error().message();
}

TEST_F(Spawn, CapturesTheLastStdoutLineAndStderr) {
  const auto result = run({"/bin/sh", "-c", "echo one; echo two; echo oops >&2; exit 4"});
  EXPECT_EQ(result.status.describe(), "exit code 4");
  EXPECT_EQ(result.last_stdout_line(), "two");
  EXPECT_EQ(result.err, "oops\n");
}

// Regression: the broker folded a signal into 128 + n and serve turned 129..192 back into
// signals, so a provider exiting 130 was reported as killed by SIGINT.
TEST_F(Spawn, ReportsAnExitCodeAbove128AsAnExitCodeAndASignalAsASignal) {
  const auto exited = run({"/bin/sh", "-c", "exit 130"});
  EXPECT_TRUE(exited.status.exited);
  EXPECT_EQ(exited.status.describe(), "exit code 130");
  const auto killed = run({"/bin/sh", "-c", "kill -9 $$"});
  EXPECT_FALSE(killed.status.exited);
  EXPECT_EQ(killed.status.signal, SIGKILL);
  EXPECT_EQ(killed.status.describe().rfind("signal 9", 0), 0u) << killed.status.describe();
}

// Regression: the route's spawner reaped the leader first and signalled its group after,
// when the group id may already be someone else's. Now what the child left in its group
// is killed while the leader's zombie still holds the id, before the reap.
TEST_F(Spawn, KillsWhatTheChildLeftInItsGroupBeforeReapingIt) {
  auto child = ChildProcess::spawn({"/bin/sh", "-c", testing::sleep_past_deadline() + " & echo $!"},
                                   SpawnOptions{.capture_stdout = true});
  ASSERT_TRUE(child) << child.error().what();
  auto finished = child->wait_for(std::chrono::seconds(20));
  ASSERT_TRUE(finished) << finished.error().what();
  ASSERT_TRUE(finished->status.ok());
  const pid_t grandchild = std::stoi(finished->out);
  // No kill_group() here: the reap itself must have taken the leftover with it.
  EXPECT_TRUE(testing::wait_until([&] { return process_gone(grandchild); }))
      << "the group's leftover " << grandchild << " outlived its reaped leader";
}

// Every kill and reap the spawner makes, in order: ('k', pid) for kill(pid, ...), ('r', pid)
// for a waitpid that reaped pid.
std::mutex g_calls_mutex;
std::vector<std::pair<char, pid_t>> g_calls;

int recording_kill(pid_t pid, int sig) {
  {
    std::lock_guard lock(g_calls_mutex);
    g_calls.emplace_back('k', pid);
  }
  return ::kill(pid, sig);
}

pid_t recording_waitpid(pid_t pid, int* status, int options) {
  const pid_t got = ::waitpid(pid, status, options);
  if (got > 0) {
    std::lock_guard lock(g_calls_mutex);
    g_calls.emplace_back('r', got);
  }
  return got;
}

void expect_group_signalled_only_before_the_reap(pid_t pid) {
  std::lock_guard lock(g_calls_mutex);
  const auto reaped = std::find(g_calls.begin(), g_calls.end(), std::pair<char, pid_t>('r', pid));
  ASSERT_NE(reaped, g_calls.end()) << "child " << pid << " was never reaped";
  EXPECT_NE(std::find(g_calls.begin(), reaped, std::pair<char, pid_t>('k', -pid)), reaped)
      << "the group of " << pid << " was not killed before its leader was reaped";
  for (auto call = reaped; call != g_calls.end(); ++call)
    EXPECT_FALSE(call->first == 'k' && (call->second == -pid || call->second == pid))
        << "kill(" << call->second << ") after " << pid << " was reaped: the id may be another process's by then";
}

// Regression: the route's spawner reaped the leader and then sent kill(-pid) "in case the
// group outlived it", and the destructor did so again: by then the group id may belong to
// someone else. Here the seam records the order of every kill and reap.
TEST_F(Spawn, SignalsAGroupOnlyWhileItsLeaderIsUnreaped) {
  sys::Ops ops = sys::real_ops();
  ops.kill = recording_kill;
  ops.waitpid = recording_waitpid;
  {
    std::lock_guard lock(g_calls_mutex);
    g_calls.clear();
  }
  pid_t exited = -1, timed_out = -1;
  {
    sys::ScopedOverride seam(ops);
    {
      // The leader exits by itself and leaves a process in its group.
      auto child = ChildProcess::spawn({"/bin/sh", "-c", "sleep 30 & exit 0"}, {});
      ASSERT_TRUE(child) << child.error().what();
      exited = child->pid();
      auto finished = child->wait_for(std::chrono::seconds(20));
      ASSERT_TRUE(finished) << finished.error().what();
    }  // and the destructor runs after the reap
    {
      // The leader is killed at its deadline.
      auto child = ChildProcess::spawn({"/bin/sh", "-c", "sleep 30 & sleep 30"}, {});
      ASSERT_TRUE(child) << child.error().what();
      timed_out = child->pid();
      EXPECT_TRUE(child->wait_or_kill(std::chrono::milliseconds(300)).timed_out);
    }
  }
  expect_group_signalled_only_before_the_reap(exited);
  expect_group_signalled_only_before_the_reap(timed_out);
}

TEST_F(Spawn, KillsTheProcessGroupAtTheDeadline) {
  testing::TempDir dir;
  const auto pid_file = dir / "grandchild.pid";
  const std::string outliving = testing::sleep_past_deadline();
  auto child =
      ChildProcess::spawn({"/bin/sh", "-c", outliving + " & echo $! > \"$0\"; " + outliving, pid_file.string()}, {});
  ASSERT_TRUE(child) << child.error().what();
  // The deadline starts once the group has its leftover: a busy machine may take longer
  // than the deadline itself to get the shell that far.
  const pid_t grandchild = wait_for_pid_file(pid_file);
  const auto start = std::chrono::steady_clock::now();
  const Finished result = child->wait_or_kill(std::chrono::milliseconds(300));
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_TRUE(result.timed_out);
  EXPECT_LT(waited, std::chrono::seconds(5));
  ASSERT_GT(grandchild, 0) << "the shell never wrote its background pid";
  EXPECT_TRUE(testing::wait_until([&] { return process_gone(grandchild); }))
      << "the group's leftover " << grandchild << " outlived the deadline";
}

// Regression: the broker's provider inherited serve's blocked SIGTERM and ignored SIGPIPE.
TEST_F(Spawn, StartsTheChildWithNoBlockedSignalsAndSigpipeAtItsDefault) {
  sigset_t block, previous;
  sigemptyset(&block);
  sigaddset(&block, SIGTERM);
  ::pthread_sigmask(SIG_BLOCK, &block, &previous);
  struct sigaction ignore {
  }, previous_pipe{};
  ignore.sa_handler = SIG_IGN;
  ::sigaction(SIGPIPE, &ignore, &previous_pipe);
  const auto result = run({"/bin/grep", "-E", "^Sig(Blk|Ign)", "/proc/self/status"});
  ::sigaction(SIGPIPE, &previous_pipe, nullptr);
  ::pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  ASSERT_TRUE(result.status.ok()) << result.err;
  EXPECT_EQ(result.out, "SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n");
}

// Regression: fork() write-protected every page of the caller (kvshare-serve) for
// copy-on-write, so each page it wrote afterwards faulted again, and on a VM with shadow
// page tables fork to exec took tens of milliseconds per provider (docs/hybrid.md,
// "Processes and descriptors"). The child now shares the caller's memory until it execs.
TEST_F(Spawn, LeavesTheCallersPagesWritableWithoutAFault) {
  constexpr size_t kBytes = 64u << 20;
  void* memory = ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(memory, MAP_FAILED);
  ::madvise(memory, kBytes, MADV_NOHUGEPAGE);  // 16,384 pages, each its own fault if any
  auto* bytes = static_cast<volatile char*>(memory);
  for (size_t i = 0; i < kBytes; i += 4096) bytes[i] = 1;
  const auto result = run({"/bin/true"});
  ASSERT_TRUE(result.status.ok()) << result.err;
  auto minor_faults = [] {
    rusage usage{};
    ::getrusage(RUSAGE_THREAD, &usage);
    return usage.ru_minflt;
  };
  const long before = minor_faults();
  for (size_t i = 0; i < kBytes; i += 4096) bytes[i] = 2;
  const long faults = minor_faults() - before;
  ::munmap(memory, kBytes);
  EXPECT_LT(faults, 1024) << "writing 16,384 pages after a spawn faulted " << faults << " times";
}

TEST_F(Spawn, NamesAProgramThatCannotStart) {
  testing::TempDir dir;
  auto result = run_child({(dir / "no-such-provider").string()}, {}, std::chrono::seconds(1));
  ASSERT_FALSE(result);
  EXPECT_EQ(result.error().errno_value(), ENOENT);
  EXPECT_NE(result.error().message().find("no-such-provider"), std::string::npos);
}

// The death signal is set by exec'ing through setpriv and a shell: the child must still get
// exactly the told descriptors, no blocked signal, and its own exit code.
TEST_F(Spawn, PassesTheSameDescriptorsAndSignalsWhenItDiesWithItsParent) {
  Fd stray(::socket(AF_INET, SOCK_STREAM, 0));  // no SOCK_CLOEXEC
  Fd told(::memfd_create("spawn-told", MFD_CLOEXEC));
  SpawnOptions options;
  options.inherit_fds = {{told.get(), 9}};
  options.die_with_parent = true;
  const auto result = run({"/bin/sh", "-c",
                           "ls /proc/self/fd | tr '\\n' ' '; grep -E '^Sig(Blk|Ign)' /proc/self/status; "
                           "exit 5"},
                          options);
  EXPECT_EQ(result.status.describe(), "exit code 5") << result.err;
  EXPECT_EQ(result.out, "0 1 2 3 9 SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n");
}

// Regression guard for the death-signal path: the program's exec happens in the shell, which
// cannot report back, so a missing program must be refused before the spawn.
TEST_F(Spawn, NamesAMissingProgramThatShouldDieWithItsParent) {
  testing::TempDir dir;
  auto result =
      run_child({(dir / "no-such-decoder").string()}, SpawnOptions{.die_with_parent = true}, std::chrono::seconds(1));
  ASSERT_FALSE(result);
  EXPECT_EQ(result.error().errno_value(), ENOENT);
  EXPECT_NE(result.error().message().find("no-such-decoder"), std::string::npos) << result.error().message();
}

TEST_F(Spawn, SignalsAChildThatDiesWithItsParentWhenTheParentDies) {
  testing::TempDir dir;
  const auto pid_file = dir / "child.pid";
  // A parent of our own to kill: it spawns the child, tells us its pid, and waits.
  const pid_t parent = ::fork();
  ASSERT_GE(parent, 0);
  if (parent == 0) {
    // exec: the death signal is the process's own, a process the shell forked would not get it.
    auto child = ChildProcess::spawn({"/bin/sh", "-c", "exec " + testing::sleep_past_deadline()},
                                     SpawnOptions{.die_with_parent = true});
    if (!child) ::_exit(1);
    std::ofstream(pid_file) << child->pid() << "\n";
    ::pause();
    ::_exit(0);
  }
  const pid_t child = wait_for_pid_file(pid_file);
  // Through setpriv and the parent check to the program: a check that failed would end the
  // child before its parent did, and this test would pass without a death signal.
  const bool reached_program = child > 0 && testing::wait_until([&] {
                                 std::ifstream cmdline("/proc/" + std::to_string(child) + "/cmdline");
                                 std::string argv0;
                                 return std::getline(cmdline, argv0, '\0') && argv0.ends_with("sleep");
                               });
  ::kill(parent, SIGKILL);
  ::waitpid(parent, nullptr, 0);
  ASSERT_GT(child, 0) << "the parent never wrote its child's pid";
  ASSERT_TRUE(reached_program) << "child " << child << " never exec'd sleep";
  EXPECT_TRUE(testing::wait_until([&] { return process_gone(child); }))
      << "child " << child << " outlived its killed parent";
}

TEST_F(Spawn, TerminateGivesTheChildItsGraceThenReportsHowItEnded) {
  auto child = ChildProcess::spawn({"/bin/sh", "-c", "trap 'exit 7' TERM; while :; do sleep 0.01; done"}, {});
  ASSERT_TRUE(child) << child.error().what();
  // Until the shell has installed its trap, SIGTERM kills it: wait for the handler itself.
  ASSERT_TRUE(testing::wait_until([&] { return catches_signal(child->pid(), SIGTERM); }))
      << "the shell never installed its TERM trap";
  const ExitStatus status = child->terminate(std::chrono::seconds(10));
  EXPECT_EQ(status.describe(), "exit code 7");
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
