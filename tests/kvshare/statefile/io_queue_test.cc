// IoQueue in both of its modes, io_uring and pread/pwrite: every request completes exactly
// once, bytes land where asked, and a failure surfaces (naming the offset) instead of
// hanging or being lost.
#include "kvshare/statefile/io_queue.h"

#include <fcntl.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <set>
#include <vector>

#include "kvshare/fd.h"
#include "kvshare/sys.h"
#include "support/test_support.h"

namespace kvshare::statefile {
namespace {

constexpr size_t kBlock = 4096;

struct Mode {
  const char* name;
  bool allow_io_uring;
};

const Mode kModes[] = {{"io_uring", true}, {"pread_pwrite", false}};

class IoQueueTest : public ::testing::TestWithParam<Mode> {
 protected:
  Fd open_file(const char* name) {
    path_ = dir_ / name;
    return Fd(::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  }
  std::unique_ptr<IoQueue> make_queue(int fd, unsigned depth) {
    auto queue = IoQueue::create(fd, path_.string(), false, depth, GetParam().allow_io_uring);
    EXPECT_TRUE(queue) << queue.error().what();
    return queue ? std::move(*queue) : nullptr;
  }
  testing::TempDir dir_;
  std::filesystem::path path_;
};

TEST_P(IoQueueTest, CompletesEveryWriteOnceWithItsBytesInPlace) {
  Fd fd = open_file("out.bin");
  ASSERT_TRUE(fd);
  auto queue = make_queue(fd.get(), 2);
  ASSERT_TRUE(queue);
  if (!GetParam().allow_io_uring) EXPECT_STREQ(queue->backend_name(), "pread/pwrite");
  constexpr int kRequests = 16;
  std::vector<std::vector<std::byte>> buffers(kRequests, std::vector<std::byte>(kBlock));
  std::set<uint64_t> tags;
  size_t completed_early = 0;
  for (int i = 0; i < kRequests; ++i) {
    std::fill(buffers[i].begin(), buffers[i].end(), std::byte(i + 1));
    IoRequest request;
    request.data = buffers[i].data();
    request.length = kBlock;
    request.offset = (kRequests - 1 - i) * kBlock;  // back to front: offsets, not order, place bytes
    request.tag = static_cast<uint64_t>(i);
    ASSERT_TRUE(queue->submit(request));
    if (i % 4 == 3 && queue->in_flight() > 0) {  // take one completion now and then, as the writer does
      auto done = queue->wait();
      ASSERT_TRUE(done) << done.error().what();
      EXPECT_EQ(done->done, kBlock);
      EXPECT_TRUE(tags.insert(done->tag).second) << "tag " << done->tag << " completed twice";
      ++completed_early;
    }
  }
  for (;;) {
    if (queue->in_flight() == 0) break;
    auto done = queue->wait();
    ASSERT_TRUE(done) << done.error().what();
    EXPECT_TRUE(tags.insert(done->tag).second) << "tag " << done->tag << " completed twice";
  }
  EXPECT_EQ(tags.size(), static_cast<size_t>(kRequests));
  EXPECT_GT(completed_early, 0u);
  auto drained = queue->drain();
  ASSERT_TRUE(drained);
  EXPECT_EQ(*drained, 0u);
  EXPECT_EQ(queue->stats().requests, static_cast<uint64_t>(kRequests));
  const auto bytes = testing::read_file_bytes(path_);
  ASSERT_EQ(bytes.size(), kRequests * kBlock);
  for (int i = 0; i < kRequests; ++i)
    EXPECT_EQ(bytes[(kRequests - 1 - i) * kBlock], std::byte(i + 1)) << "request " << i;
}

TEST_P(IoQueueTest, WaitWithNothingInFlightIsAnErrorNotAHang) {
  Fd fd = open_file("idle.bin");
  auto queue = make_queue(fd.get(), 4);
  ASSERT_TRUE(queue);
  auto done = queue->wait();
  ASSERT_FALSE(done);
  EXPECT_EQ(done.error().errno_value(), EINVAL);
  EXPECT_NE(done.error().message().find("nothing in flight"), std::string::npos);
}

// pwrite writes nothing from the third call on: ENOSPC, as a full disk looks.
struct FullAfterTwo {
  static inline std::atomic<int> calls{0};
  static ssize_t pwrite(int fd, const void* buf, size_t count, off_t offset) {
    if (++calls > 2) return 0;
    return sys::real_ops().pwrite(fd, buf, count, offset);
  }
};

TEST_P(IoQueueTest, ReportsAFailedWriteWithItsOffset) {
  if (GetParam().allow_io_uring) GTEST_SKIP() << "the syscall seam does not reach io_uring's transfers";
  sys::Ops ops = sys::real_ops();
  ops.pwrite = FullAfterTwo::pwrite;
  FullAfterTwo::calls = 0;
  sys::ScopedOverride scoped(ops);
  Fd fd = open_file("full.bin");
  auto queue = make_queue(fd.get(), 2);
  ASSERT_TRUE(queue);
  std::vector<std::byte> buffer(kBlock, std::byte{7});
  // pread/pwrite: the submit whose transfer failed fails, naming where; nothing is left over.
  for (int i = 0; i < 3; ++i) {
    IoRequest request;
    request.data = buffer.data();
    request.length = kBlock;
    request.offset = static_cast<uint64_t>(i) * kBlock;
    auto submitted = queue->submit(request);
    if (i < 2) {
      ASSERT_TRUE(submitted) << submitted.error().what();
      continue;
    }
    ASSERT_FALSE(submitted) << "a write that wrote nothing was not reported";
    EXPECT_EQ(submitted.error().errno_value(), ENOSPC);
    EXPECT_NE(submitted.error().message().find("offset 8192"), std::string::npos) << submitted.error().message();
  }
  auto drained = queue->drain();
  ASSERT_TRUE(drained) << drained.error().what();
  EXPECT_EQ(*drained, 2u);
}

INSTANTIATE_TEST_SUITE_P(Modes, IoQueueTest, ::testing::ValuesIn(kModes),
                         [](const ::testing::TestParamInfo<Mode>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace kvshare::statefile
