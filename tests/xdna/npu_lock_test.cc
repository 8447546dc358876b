#include "xdna/npu_lock.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "kvshare/sys.h"
#include "support/test_support.h"

namespace kvshare::xdna {
namespace {

using kvshare::testing::FdLeakCheck;
using kvshare::testing::TempDir;

class NpuLockTest : public FdLeakCheck {};

TEST_F(NpuLockTest, WritesTheHoldersPidIntoTheLockFile) {
  TempDir dir;
  const std::string path = (dir / "npu.lock").string();
  auto lock = acquire_npu_lock(path, 0);
  ASSERT_TRUE(lock) << lock.error().what();
  EXPECT_TRUE(lock->held());
  EXPECT_EQ(npu_lock_holder(path), getpid());
}

// Regression: the file was created with open(..., 0666), which the umask cut to 0644, so
// only its creator could ever take the lock again.
TEST_F(NpuLockTest, CreatesTheLockFileSoEveryUserCanOpenItWhateverTheUmask) {
  TempDir dir;
  const std::string path = (dir / "npu.lock").string();
  const mode_t previous = ::umask(022);
  auto lock = acquire_npu_lock(path, 0);
  ::umask(previous);
  ASSERT_TRUE(lock) << lock.error().what();
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0666u);
}

TEST_F(NpuLockTest, MakesASecondTakerTimeOutNamingTheHolder) {
  TempDir dir;
  const std::string path = (dir / "npu.lock").string();
  auto first = acquire_npu_lock(path, 0);
  ASSERT_TRUE(first);
  // flock conflicts between two open file descriptions even in one process.
  auto second = acquire_npu_lock(path, 60);
  ASSERT_FALSE(second);
  EXPECT_EQ(second.error().errno_value(), ETIMEDOUT);
  EXPECT_NE(second.error().message().find(fmt::format("held by pid {}", getpid())), std::string::npos)
      << second.error().message();
  EXPECT_NE(second.error().message().find("60 ms"), std::string::npos);
}

// How often a flock found the lock taken (EWOULDBLOCK): a waiter is waiting once it is > 0.
std::atomic<int> g_refused_flocks{0};

int counting_flock(int fd, int operation) {
  const int rc = sys::real_ops().flock(fd, operation);
  if (rc != 0 && errno == EWOULDBLOCK) ++g_refused_flocks;
  return rc;
}

TEST_F(NpuLockTest, LetsAWaiterInOnceTheHolderReleases) {
  TempDir dir;
  const std::string path = (dir / "npu.lock").string();
  auto first = acquire_npu_lock(path, 0);
  ASSERT_TRUE(first);
  sys::Ops ops = sys::real_ops();
  ops.flock = counting_flock;
  g_refused_flocks = 0;
  sys::ScopedOverride seam(ops);
  // Released once the waiter has found the lock taken, not after a time: a waiter that
  // came late would find it free and show nothing about waiting.
  std::atomic<bool> saw_waiter{false};
  std::thread releaser([&] {
    saw_waiter = kvshare::testing::wait_until([] { return g_refused_flocks > 0; });
    first->release();
  });
  const int wait_ms = static_cast<int>(std::chrono::milliseconds(kvshare::testing::kLoadedDeadline).count());
  auto second = acquire_npu_lock(path, wait_ms);
  releaser.join();
  EXPECT_TRUE(saw_waiter) << "the waiter never found the lock taken";
  ASSERT_TRUE(second) << second.error().what();
  EXPECT_TRUE(second->held());
}

TEST_F(NpuLockTest, ClearsThePidWhenReleased) {
  TempDir dir;
  const std::string path = (dir / "npu.lock").string();
  {
    auto lock = acquire_npu_lock(path, 0);
    ASSERT_TRUE(lock);
  }
  EXPECT_EQ(npu_lock_holder(path), 0);
}

TEST_F(NpuLockTest, NamesThePathWhenTheFileCannotBeOpened) {
  TempDir dir;
  const std::string path = (dir / "missing-dir" / "npu.lock").string();
  auto lock = acquire_npu_lock(path, 0);
  ASSERT_FALSE(lock);
  EXPECT_EQ(lock.error().errno_value(), ENOENT);
  EXPECT_NE(lock.error().message().find(path), std::string::npos);
}

TEST(NpuLockPath, FollowsTheEnvironmentOverride) {
  EXPECT_EQ(std::string(kNpuLockPath), "/tmp/1bit-npu-device.lock");
  setenv("KVSHARE_NPU_LOCK", "/run/custom.lock", 1);
  EXPECT_EQ(default_npu_lock_path(), "/run/custom.lock");
  unsetenv("KVSHARE_NPU_LOCK");
  EXPECT_EQ(default_npu_lock_path(), kNpuLockPath);
}

}  // namespace
}  // namespace kvshare::xdna
