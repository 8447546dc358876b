// Device discovery and PRIME import. No machine here has an NPU: discovery is checked on
// fake accel directories, the import on a stand-in driver behind the syscall seam, and
// the real-device test skips with the reason.
#include "xdna/device.h"

#include <fcntl.h>
#include <libdrm/drm.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>

#include "fake_amdxdna.h"
#include "kvshare/sys.h"
#include "support/test_support.h"

namespace kvshare::xdna {
namespace {

using kvshare::testing::FdLeakCheck;
using kvshare::testing::TempDir;
using kvshare::xdna::testing::fake_device;
using kvshare::xdna::testing::FakeDriver;
using kvshare::xdna::testing::ScopedFakeDriver;

class XdnaDeviceTest : public FdLeakCheck {};

TEST_F(XdnaDeviceTest, NamesTheDirectoryWhenThereIsNoAccelDirectory) {
  TempDir dir;
  auto device = find_device((dir / "accel").string());
  ASSERT_FALSE(device);
  EXPECT_EQ(device.error().errno_value(), ENOENT);
  EXPECT_NE(device.error().message().find("looking for an AMD XDNA NPU: cannot list"), std::string::npos)
      << device.error().message();
}

TEST_F(XdnaDeviceTest, SaysNoNodeExistsWhenTheDirectoryIsEmpty) {
  TempDir dir;
  std::ofstream(dir / "card0") << "";  // not an accel node: ignored
  auto device = find_device(dir.path().string());
  ASSERT_FALSE(device);
  EXPECT_EQ(device.error().errno_value(), ENODEV);
  EXPECT_NE(device.error().message().find("no accel<N> node in"), std::string::npos) << device.error().message();
}

TEST_F(XdnaDeviceTest, ListsEveryNodeItLookedAtAndWhatItWas) {
  TempDir dir;
  std::ofstream(dir / "accel0") << "";  // a regular file: DRM_IOCTL_VERSION fails on it
  std::ofstream(dir / "accel3") << "";
  auto device = find_device(dir.path().string());
  ASSERT_FALSE(device);
  EXPECT_EQ(device.error().errno_value(), ENODEV);
  const std::string& message = device.error().message();
  EXPECT_NE(message.find("accel0 (not a DRM node)"), std::string::npos) << message;
  EXPECT_NE(message.find("accel3 (not a DRM node)"), std::string::npos) << message;
  EXPECT_NE(message.find("\"amdxdna\""), std::string::npos) << message;
}

TEST_F(XdnaDeviceTest, FindsTheRealNpuWhenThisMachineHasOne) {
  if (!std::filesystem::exists(kAccelDir)) GTEST_SKIP() << "no " << kAccelDir << " on this machine: no NPU to find";
  auto device = find_device();
  if (!device) GTEST_SKIP() << "no amdxdna device: " << device.error().what();
  EXPECT_EQ(device->driver, "amdxdna");
}

TEST_F(XdnaDeviceTest, ImportsADmaBufAndClosesItsHandleOnce) {
  ScopedFakeDriver fake_driver;
  XdnaDevice device = fake_device();
  Fd buffer(memfd_create("chunk", MFD_CLOEXEC));
  ASSERT_EQ(::ftruncate(buffer.get(), 4096), 0);
  {
    auto bo = import_dmabuf(device, buffer.get(), 0, 4096, "region chunk 0");
    ASSERT_TRUE(bo) << bo.error().what();
    EXPECT_EQ(bo->handle(), 7u);
    EXPECT_EQ(bo->device_address(), 0x40000u);
    ImportedBo moved = std::move(*bo);
    EXPECT_EQ(FakeDriver::gem_closes, 0);
  }
  EXPECT_EQ(FakeDriver::gem_closes, 1);
  EXPECT_EQ(FakeDriver::closed_handle, 7u);
}

TEST_F(XdnaDeviceTest, ClosesTheHandleAndNamesTheChunkWhenTheDriverRefusesBoInfo) {
  ScopedFakeDriver fake_driver(/*fail_bo_info=*/true);
  XdnaDevice device = fake_device();
  Fd buffer(memfd_create("chunk", MFD_CLOEXEC));
  ASSERT_EQ(::ftruncate(buffer.get(), 8192), 0);
  const int fds[1] = {buffer.get()};
  const uint64_t sizes[1] = {8192};
  auto bos = import_region(device, fds, sizes);
  ASSERT_FALSE(bos);
  EXPECT_EQ(bos.error().errno_value(), EINVAL);
  EXPECT_NE(bos.error().message().find("region chunk 0"), std::string::npos) << bos.error().message();
  EXPECT_NE(bos.error().message().find("GET_BO_INFO on handle 7"), std::string::npos) << bos.error().message();
  EXPECT_EQ(FakeDriver::gem_closes, 1);
}

// Regression: two chunks of one dma-buf got one GEM handle (PRIME returns the same handle
// for the same buffer) that was closed twice, and both got the buffer's start as their
// device address although the second starts at its offset.
TEST_F(XdnaDeviceTest, SharesOneHandleBetweenTwoChunksOfOneDmaBufAndAddressesEachAtItsOffset) {
  ScopedFakeDriver fake_driver;
  XdnaDevice device = fake_device();
  Fd buffer(memfd_create("two-chunks", MFD_CLOEXEC));
  ASSERT_EQ(::ftruncate(buffer.get(), 3 * 4096), 0);
  {
    const int fds[2] = {buffer.get(), buffer.get()};
    const uint64_t sizes[2] = {4096, 8192};
    const uint64_t offsets[2] = {0, 4096};
    auto bos = import_region(device, fds, sizes, offsets);
    ASSERT_TRUE(bos) << bos.error().what();
    EXPECT_EQ((*bos)[0].handle(), (*bos)[1].handle());
    EXPECT_EQ((*bos)[0].device_address(), 0x40000u);
    EXPECT_EQ((*bos)[1].device_address(), 0x40000u + 4096);
  }
  EXPECT_EQ(FakeDriver::gem_closes, 1);
}

TEST_F(XdnaDeviceTest, RefusesARangePastTheEndOfTheDmaBuf) {
  XdnaDevice device = fake_device();
  Fd buffer(memfd_create("small", MFD_CLOEXEC));
  ASSERT_EQ(::ftruncate(buffer.get(), 4096), 0);
  auto bo = import_dmabuf(device, buffer.get(), 4096, 4096, "region chunk 1");
  ASSERT_FALSE(bo);
  EXPECT_EQ(bo.error().errno_value(), EINVAL);
  EXPECT_NE(bo.error().message().find("bytes 4096..8192 pass its end at 4096"), std::string::npos)
      << bo.error().message();
}

TEST_F(XdnaDeviceTest, RefusesARegionWhoseFdsAndSizesDisagree) {
  XdnaDevice device = fake_device();
  const int fds[2] = {3, 4};
  const uint64_t sizes[1] = {4096};
  auto bos = import_region(device, fds, sizes);
  ASSERT_FALSE(bos);
  EXPECT_NE(bos.error().message().find("2 fds but the layout has 1 chunks"), std::string::npos);
}

TEST(XrtImport, RefusesCleanlyWhenThisMachineHasNoXrtDevice) {
  if (!has_xrt()) GTEST_SKIP() << "built without XRT (libxrt-dev not found)";
  if (std::filesystem::exists(kAccelDir)) GTEST_SKIP() << kAccelDir << " exists: this machine may have an NPU";
  Fd buffer(memfd_create("xrt-chunk", MFD_CLOEXEC));
  auto imported = import_xrt(0, buffer.get(), "region chunk 0");
  ASSERT_FALSE(imported);
  EXPECT_EQ(imported.error().errno_value(), EIO);
  EXPECT_NE(imported.error().message().find("as an xrt::bo on XRT device 0"), std::string::npos)
      << imported.error().message();
}

TEST(XrtImport, SaysHowToGetItWhenBuiltWithoutXrt) {
  if (has_xrt()) GTEST_SKIP() << "built with XRT; needs an NPU to import into";
  auto buffer = import_xrt(0, 5, "region chunk 0");
  ASSERT_FALSE(buffer);
  EXPECT_EQ(buffer.error().errno_value(), ENOTSUP);
  EXPECT_NE(buffer.error().message().find("built without XRT"), std::string::npos);
}

}  // namespace
}  // namespace kvshare::xdna
