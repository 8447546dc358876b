// populate_for_write: a resident provider faults the decoder's region in once, so its
// prefills take no first-touch faults; it must not change a byte the decoder wrote.
#include "kvshare/region/populate.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "kvshare/fd.h"
#include "kvshare/mapping.h"
#include "kvshare/sys.h"
#include "support/test_support.h"

namespace kvshare {
namespace {

constexpr uint64_t kBytes = 16 * 4096;

class Populate : public testing::FdLeakCheck {
 protected:
  void SetUp() override {
    testing::FdLeakCheck::SetUp();
    fd_ = Fd(::memfd_create("populate-test", MFD_CLOEXEC));
    ASSERT_TRUE(fd_);
    ASSERT_EQ(::ftruncate(fd_.get(), kBytes), 0);
    // Only page 3 has been written (by "the decoder"): the rest are holes.
    const char mark[] = "written by the decoder";
    ASSERT_EQ(::pwrite(fd_.get(), mark, sizeof mark, 3 * 4096 + 100), static_cast<ssize_t>(sizeof mark));
    auto mapping = Mapping::map(fd_.get(), 0, kBytes, true, "populate-test memfd");
    ASSERT_TRUE(mapping) << mapping.error().what();
    mapping_ = std::move(*mapping);
    // Through the descriptor: a read through the mapping would fault the holes in itself.
    before_.resize(kBytes);
    ASSERT_EQ(::pread(fd_.get(), before_.data(), kBytes, 0), static_cast<ssize_t>(kBytes));
    ASSERT_EQ(allocated_bytes(), 4096u);
  }
  void TearDown() override {
    mapping_.reset();
    fd_.reset();
    testing::FdLeakCheck::TearDown();
  }

  // 512-byte blocks the memfd holds: its pages that exist.
  uint64_t allocated_bytes() const {
    struct stat st {};
    EXPECT_EQ(::fstat(fd_.get(), &st), 0);
    return static_cast<uint64_t>(st.st_blocks) * 512;
  }
  bool unchanged() const {
    return std::equal(before_.begin(), before_.end(), mapping_.bytes().begin(), mapping_.bytes().end());
  }

  Fd fd_;
  Mapping mapping_;
  std::vector<std::byte> before_;
};

TEST_F(Populate, FaultsInEveryPageWithoutChangingAByte) {
  auto method = populate_for_write(mapping_.bytes(), "populate-test memfd");
  ASSERT_TRUE(method) << method.error().what();
  EXPECT_EQ(allocated_bytes(), kBytes);
  EXPECT_TRUE(unchanged());
}

TEST_F(Populate, ReadsOnePerPageWhereTheKernelHasNoMadvisePopulate) {
  sys::Ops ops = sys::real_ops();
  int calls = 0;
  static int* calls_seen = nullptr;
  calls_seen = &calls;
  ops.madvise = [](void*, size_t, int) {
    ++*calls_seen;
    errno = EINVAL;
    return -1;
  };
  sys::ScopedOverride scoped(ops);
  auto method = populate_for_write(mapping_.bytes(), "populate-test memfd");
  ASSERT_TRUE(method) << method.error().what();
  EXPECT_EQ(*method, PopulateMethod::touch_read);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(allocated_bytes(), kBytes);
  EXPECT_TRUE(unchanged());
}

TEST_F(Populate, NamesTheObjectAndTheAdviceWhenTheKernelRefuses) {
  sys::Ops ops = sys::real_ops();
  ops.madvise = [](void*, size_t, int) {
    errno = ENOMEM;
    return -1;
  };
  sys::ScopedOverride scoped(ops);
  auto method = populate_for_write(mapping_.bytes(), "region 4, chunk 1");
  ASSERT_FALSE(method);
  EXPECT_EQ(method.error().errno_value(), ENOMEM);
  EXPECT_NE(method.error().message().find("region 4, chunk 1: faulting in 65536 bytes"), std::string::npos)
      << method.error().message();
  EXPECT_NE(method.error().message().find("MADV_POPULATE_WRITE"), std::string::npos);
}

}  // namespace
}  // namespace kvshare
