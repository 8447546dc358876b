#include "kvshare/region/exporter.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "kvshare/sys.h"
#include "layout_fixtures.h"
#include "support/test_support.h"

namespace kvshare {
namespace {

using testing::FdLeakCheck;
using testing::TempDir;

// Options that cannot reach any device (paths inside an empty temp dir): automatic
// selection must end at memfd on every machine.
ExportOptions no_device_options(const TempDir& dir) {
  ExportOptions options;
  options.dma_heap_path = (dir / "dma_heap_system").string();
  options.udmabuf_path = (dir / "udmabuf").string();
  return options;
}

layout::ShareChunk chunk_of(uint64_t size_bytes, uint64_t hash = 0xabc) { return {0, size_bytes, hash}; }

class RegionExport : public FdLeakCheck {};

TEST_F(RegionExport, SealsAMemfdAgainstShrinkGrowAndFurtherSeals) {
  ExportOptions options;
  options.forced = RegionBackend::memfd;
  auto region = export_chunk(chunk_of(8192), 0, options);
  ASSERT_TRUE(region) << region.error().what();
  EXPECT_EQ(region->backend, RegionBackend::memfd);
  const int seals = ::fcntl(region->fd.get(), F_GET_SEALS);
  EXPECT_EQ(seals, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  // A peer holding the fd cannot truncate the pages under the owner's mapping.
  EXPECT_NE(::ftruncate(region->fd.get(), 4096), 0);
  EXPECT_EQ(errno, EPERM);
}

TEST_F(RegionExport, FallsBackToMemfdAndSaysWhyEachDeviceWasPassedOver) {
  TempDir dir;
  auto region = export_chunk(chunk_of(4096), 3, no_device_options(dir));
  ASSERT_TRUE(region) << region.error().what();
  EXPECT_EQ(region->backend, RegionBackend::memfd);
  EXPECT_EQ(region->chunk, 3u);
  EXPECT_NE(region->fallback_reason.find("dmaheap: open " + (dir / "dma_heap_system").string()), std::string::npos)
      << region->fallback_reason;
  EXPECT_NE(region->fallback_reason.find("udmabuf: open " + (dir / "udmabuf").string()), std::string::npos)
      << region->fallback_reason;
}

TEST_F(RegionExport, PassesOverUdmabufForAChunkPastItsSizeLimit) {
  TempDir dir;
  ExportOptions options = no_device_options(dir);
  options.udmabuf_limit_bytes = 4096;
  auto region = export_chunk(chunk_of(8192), 0, options);
  ASSERT_TRUE(region) << region.error().what();
  EXPECT_EQ(region->backend, RegionBackend::memfd);
  EXPECT_NE(region->fallback_reason.find("udmabuf: 8192 bytes is past udmabuf's size_limit_mb"), std::string::npos)
      << region->fallback_reason;
}

TEST_F(RegionExport, DoesNotFallBackFromAForcedBackend) {
  TempDir dir;
  ExportOptions options = no_device_options(dir);
  options.forced = RegionBackend::udmabuf;
  auto region = export_chunk(chunk_of(4096), 0, options);
  ASSERT_FALSE(region);
  EXPECT_EQ(region.error().errno_value(), ENOENT);
  EXPECT_NE(region.error().message().find("backend forced by KVSHARE_EXPORT: udmabuf: open"), std::string::npos)
      << region.error().message();
  EXPECT_EQ(region.error().message().find("memfd"), std::string::npos) << region.error().message();
}

TEST_F(RegionExport, RefusesAChunkThatIsNotAMultipleOf4096) {
  ExportOptions options;
  auto region = export_chunk(chunk_of(5000), 1, options);
  ASSERT_FALSE(region);
  EXPECT_EQ(region.error().errno_value(), EINVAL);
  EXPECT_NE(region.error().message().find("chunk 1: size 5000 bytes"), std::string::npos);
}

TEST_F(RegionExport, GivesTheOwnerAMappingThatSharesPagesWithTheFd) {
  ExportOptions options;
  options.forced = RegionBackend::memfd;
  auto region = export_chunk(chunk_of(8192), 0, options);
  ASSERT_TRUE(region) << region.error().what();
  ASSERT_EQ(region->mapping.size(), 8192u);
  std::memset(region->mapping.data() + 4096, 0x5a, 16);
  unsigned char byte = 0;
  ASSERT_EQ(::pread(region->fd.get(), &byte, 1, 4100), 1);
  EXPECT_EQ(byte, 0x5a);
}

TEST_F(RegionExport, MakesOneRegionPerChunkInFdOrder) {
  const auto share = testing::small_share_layout(2, 256, 64, 1);
  ASSERT_EQ(share.chunks.size(), 4u);
  ExportOptions options;
  options.forced = RegionBackend::memfd;
  auto regions = export_regions(share, options);
  ASSERT_TRUE(regions) << regions.error().what();
  ASSERT_EQ(regions->size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ((*regions)[i].chunk, i);
    EXPECT_EQ((*regions)[i].size_bytes, share.chunks[i].size_bytes);
    EXPECT_EQ((*regions)[i].layout_hash, share.chunks[i].layout_hash);
  }
  EXPECT_EQ(describe_backends(*regions), "memfd");
}

TEST_F(RegionExport, ClosesTheMemfdWhenSealingFails) {
  sys::Ops ops = sys::real_ops();
  ops.fcntl_int = [](int fd, int cmd, int arg) -> int {
    if (cmd == F_ADD_SEALS) return errno = EPERM, -1;
    return sys::real_ops().fcntl_int(fd, cmd, arg);
  };
  sys::ScopedOverride override(ops);
  ExportOptions options;
  options.forced = RegionBackend::memfd;
  auto region = export_chunk(chunk_of(4096), 0, options);
  ASSERT_FALSE(region);
  EXPECT_EQ(region.error().errno_value(), EPERM);
  EXPECT_NE(region.error().message().find("F_ADD_SEALS"), std::string::npos) << region.error().message();
}

TEST_F(RegionExport, ReleasesEarlierChunksWhenALaterChunkFails) {
  static int calls;
  calls = 0;
  sys::Ops ops = sys::real_ops();
  ops.memfd_create = [](const char* name, unsigned flags) -> int {
    if (++calls == 3) return errno = EMFILE, -1;
    return sys::real_ops().memfd_create(name, flags);
  };
  sys::ScopedOverride override(ops);
  ExportOptions options;
  options.forced = RegionBackend::memfd;
  auto regions = export_regions(testing::small_share_layout(2, 256, 64, 1), options);
  ASSERT_FALSE(regions);
  EXPECT_EQ(regions.error().errno_value(), EMFILE);
  EXPECT_NE(regions.error().message().find("chunk 2"), std::string::npos) << regions.error().message();
}

TEST_F(RegionExport, AllocatesFromTheDmaHeapWhereTheDeviceExists) {
  if (!std::filesystem::exists("/dev/dma_heap/system")) GTEST_SKIP() << "no /dev/dma_heap/system on this machine";
  ExportOptions options;
  options.forced = RegionBackend::dma_heap;
  auto region = export_chunk(chunk_of(1 << 20), 0, options);
  ASSERT_TRUE(region) << region.error().what();
  EXPECT_EQ(region->backend, RegionBackend::dma_heap);
}

TEST_F(RegionExport, MakesAUdmabufWhereTheDeviceExists) {
  if (!std::filesystem::exists("/dev/udmabuf")) GTEST_SKIP() << "no /dev/udmabuf on this machine";
  ExportOptions options;
  options.forced = RegionBackend::udmabuf;
  auto region = export_chunk(chunk_of(1 << 20), 0, options);
  ASSERT_TRUE(region) << region.error().what();
  EXPECT_EQ(region->backend, RegionBackend::udmabuf);
}

TEST_F(RegionExport, RefusesToWrapAMemfdAsADeviceDmabuf) {
  Fd memfd(::memfd_create("not-a-dmabuf", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_TRUE(memfd);
  ASSERT_EQ(::ftruncate(memfd.get(), 4096), 0);
  ASSERT_EQ(::fcntl(memfd.get(), F_ADD_SEALS, F_SEAL_SHRINK), 0);
  auto region = wrap_device_dmabuf(std::move(memfd), 0, chunk_of(4096), 0);
  ASSERT_FALSE(region);
  EXPECT_EQ(region.error().errno_value(), EINVAL);
  EXPECT_NE(region.error().message().find("not a dma-buf a driver made"), std::string::npos);
}

TEST_F(RegionExport, NamesTheGemHandleWhenDrmPrimeExportFails) {
  // No DRM device here: an fd that is not one makes the PRIME ioctl fail.
  Fd not_drm(::memfd_create("not-drm", MFD_CLOEXEC));
  ASSERT_TRUE(not_drm);
  auto prime = drm_prime_export(not_drm.get(), 7);
  ASSERT_FALSE(prime);
  EXPECT_NE(prime.error().errno_value(), 0);
  EXPECT_NE(prime.error().message().find("GEM handle 7"), std::string::npos) << prime.error().message();
}

}  // namespace
}  // namespace kvshare
