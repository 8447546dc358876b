#include "kvshare/region/importer.h"

#include <fcntl.h>
#include <linux/dma-buf.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "kvshare/region/exporter.h"
#include "kvshare/sys.h"
#include "layout_fixtures.h"
#include "support/test_support.h"

namespace kvshare {
namespace {

using testing::FdLeakCheck;

Fd sealed_memfd(uint64_t size_bytes, int seals = F_SEAL_SHRINK) {
  Fd fd(::memfd_create("importer-test", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  EXPECT_TRUE(fd);
  EXPECT_EQ(::ftruncate(fd.get(), static_cast<off_t>(size_bytes)), 0);
  if (seals != 0) {
    EXPECT_EQ(::fcntl(fd.get(), F_ADD_SEALS, seals), 0);
  }
  return fd;
}

std::vector<Fd> exported_fds(const layout::ShareLayout& share, std::vector<ExportedRegion>& regions) {
  ExportOptions options;
  options.forced = RegionBackend::memfd;
  regions = std::move(*export_regions(share, options));
  std::vector<Fd> fds;
  for (const auto& region : regions) fds.emplace_back(::fcntl(region.fd.get(), F_DUPFD_CLOEXEC, 0));
  return fds;
}

class RegionImport : public FdLeakCheck {};

TEST_F(RegionImport, MapsTheExportersPagesWithItsOwnMapping) {
  const auto share = testing::small_share_layout();
  std::vector<ExportedRegion> regions;
  auto imported = ImportedShare::import(share, exported_fds(share, regions), {}, true);
  ASSERT_TRUE(imported) << imported.error().what();
  EXPECT_NE(imported->regions()[0].mapping.data(), regions[0].mapping.data());
  auto view = imported->view("cache_v_l1");
  ASSERT_TRUE(view) << view.error().what();
  std::memset(view->row(3).data(), 0x77, view->row_bytes);
  const auto* placement = view->placement;
  EXPECT_EQ(static_cast<unsigned char>(regions[0].mapping.data()[placement->offset + 3 * view->row_bytes]), 0x77);
}

TEST_F(RegionImport, RefusesAMemfdThatIsNotSealedAgainstShrinking) {
  auto region = import_region(sealed_memfd(4096, 0), 0, 0, 4096, true);
  ASSERT_FALSE(region);
  EXPECT_EQ(region.error().errno_value(), EINVAL);
  EXPECT_NE(region.error().message().find("not sealed against shrinking"), std::string::npos)
      << region.error().message();
}

TEST_F(RegionImport, RefusesARegularFileNamingWhatItIs) {
  testing::TempDir dir;
  const auto path = dir / "kv.bin";
  std::ofstream(path) << std::string(8192, 'x');
  auto region = import_region(Fd(::open(path.c_str(), O_RDWR | O_CLOEXEC)), 0, 0, 4096, true);
  ASSERT_FALSE(region);
  EXPECT_EQ(region.error().errno_value(), EINVAL);
  EXPECT_NE(region.error().message().find("neither a sealed memfd nor a dma-buf"), std::string::npos);
  EXPECT_NE(region.error().message().find(path.string()), std::string::npos) << region.error().message();
}

TEST_F(RegionImport, RefusesAPipe) {
  int ends[2];
  ASSERT_EQ(::pipe2(ends, O_CLOEXEC), 0);
  Fd write_end(ends[1]);
  auto region = import_region(Fd(ends[0]), 2, 0, 4096, false);
  ASSERT_FALSE(region);
  EXPECT_NE(region.error().message().find("(chunk 2): is neither"), std::string::npos) << region.error().message();
}

TEST_F(RegionImport, RefusesAnFdShorterThanItsChunk) {
  auto region = import_region(sealed_memfd(4096), 1, 0, 8192, true);
  ASSERT_FALSE(region);
  EXPECT_EQ(region.error().errno_value(), EINVAL);
  EXPECT_NE(region.error().message().find("memfd is 4096 bytes, the layout needs 8192"), std::string::npos)
      << region.error().message();
}

TEST_F(RegionImport, RefusesAnFdCountThatDiffersFromTheChunkCount) {
  const auto share = testing::small_share_layout(2, 256, 64, 2);  // 2 chunks
  std::vector<Fd> fds;
  fds.push_back(sealed_memfd(share.chunks[0].size_bytes));
  auto imported = ImportedShare::import(share, std::move(fds), {}, true);
  ASSERT_FALSE(imported);
  EXPECT_NE(imported.error().message().find("1 fds for a layout of 2 chunks"), std::string::npos);
}

TEST_F(RegionImport, ClosesEveryFdWhenALaterChunkIsRefused) {
  const auto share = testing::small_share_layout(2, 256, 64, 2);
  std::vector<Fd> fds;
  fds.push_back(sealed_memfd(share.chunks[0].size_bytes));
  fds.push_back(sealed_memfd(4096));  // too short for chunk 1
  auto imported = ImportedShare::import(share, std::move(fds), {}, true);
  ASSERT_FALSE(imported);
  EXPECT_NE(imported.error().message().find("(chunk 1)"), std::string::npos) << imported.error().message();
  // FdLeakCheck proves both fds were closed.
}

TEST_F(RegionImport, ViewsAddressEachTensorAtItsLayoutOffset) {
  const auto share = testing::small_share_layout(3, 128, 32, 2);
  std::vector<ExportedRegion> regions;
  auto imported = ImportedShare::import(share, exported_fds(share, regions), {}, true);
  ASSERT_TRUE(imported) << imported.error().what();
  for (const auto& tensor : share.tensors) {
    auto view = imported->view(tensor.tensor.name);
    ASSERT_TRUE(view) << view.error().what();
    EXPECT_EQ(view->base, imported->chunk_bytes()[tensor.chunk].data() + tensor.offset) << tensor.tensor.name;
    EXPECT_EQ(view->row_bytes, 64u);
    EXPECT_EQ(view->rows, 128u);
    EXPECT_EQ(view->type, layout::GgmlType::F16);
  }
  auto layer = imported->layer(0, 2);
  ASSERT_TRUE(layer) << layer.error().what();
  EXPECT_EQ(layer->k.name(), "cache_k_l2");
  EXPECT_TRUE(layer->has_v);
  EXPECT_EQ(layer->v.name(), "cache_v_l2");
}

TEST_F(RegionImport, NamesAnUnknownTensor) {
  const auto share = testing::small_share_layout();
  std::vector<ExportedRegion> regions;
  auto imported = ImportedShare::import(share, exported_fds(share, regions), {}, false);
  ASSERT_TRUE(imported) << imported.error().what();
  auto view = imported->view("cache_k_l9");
  ASSERT_FALSE(view);
  EXPECT_EQ(view.error().errno_value(), ENOENT);
  EXPECT_NE(view.error().message().find("cache_k_l9"), std::string::npos);
}

TEST_F(RegionImport, RefusesATensorThatLiesOutsideItsChunk) {
  auto share = testing::small_share_layout();
  share.tensors[1].offset = share.chunks[0].size_bytes - 4096;
  std::vector<ExportedRegion> regions;
  auto imported = ImportedShare::import(share, exported_fds(share, regions), {}, false);
  ASSERT_TRUE(imported) << imported.error().what();
  auto view = imported->view("cache_v_l0");
  ASSERT_FALSE(view);
  EXPECT_NE(view.error().message().find("outside chunk 0"), std::string::npos) << view.error().message();
}

TEST_F(RegionImport, NeedsNoCpuAccessBracketForMemfdRegions) {
  const auto share = testing::small_share_layout();
  std::vector<ExportedRegion> regions;
  auto imported = ImportedShare::import(share, exported_fds(share, regions), {}, true);
  ASSERT_TRUE(imported);
  auto guards = imported->begin_cpu_access(DmaBufCpuAccess::Mode::write);
  ASSERT_TRUE(guards) << guards.error().what();
  EXPECT_TRUE(guards->empty());
}

TEST_F(RegionImport, HandsOutEachMemfdChunksDescriptorToWriteThrough) {
  const auto share = testing::small_share_layout(3, 128, 32, 2);
  std::vector<ExportedRegion> regions;
  auto imported = ImportedShare::import(share, exported_fds(share, regions), {}, true);
  ASSERT_TRUE(imported) << imported.error().what();
  const auto files = imported->chunk_files();
  ASSERT_EQ(files.size(), share.chunks.size());
  for (uint32_t i = 0; i < files.size(); ++i) {
    EXPECT_EQ(files[i].fd, imported->regions()[i].fd.get());
    EXPECT_EQ(files[i].offset, 0u);
    EXPECT_EQ(files[i].chunk, i);
  }
  // What goes through the descriptor is what the mapping shows.
  const std::byte pattern[3] = {std::byte{1}, std::byte{2}, std::byte{3}};
  ASSERT_TRUE(write_chunk_file(files[0], 4096, pattern));
  EXPECT_EQ(std::memcmp(imported->chunk_bytes()[0].data() + 4096, pattern, 3), 0);
}

// The dma-buf sync guard, driven through the seam (no dma-buf exists on this machine).
struct SyncLog {
  static inline std::vector<unsigned long long> flags;
  static inline int eintr_left = 0;
};

TEST(DmaBufCpuAccess, RetriesEintrThenEndsTheAccessItStarted) {
  SyncLog::flags.clear();
  SyncLog::eintr_left = 2;
  sys::Ops ops = sys::real_ops();
  ops.ioctl_ptr = [](int, unsigned long request, void* arg) -> int {
    if (request != DMA_BUF_IOCTL_SYNC) return errno = ENOTTY, -1;
    if (SyncLog::eintr_left > 0) return --SyncLog::eintr_left, errno = EINTR, -1;
    SyncLog::flags.push_back(static_cast<dma_buf_sync*>(arg)->flags);
    return 0;
  };
  sys::ScopedOverride override(ops);
  {
    auto guard = DmaBufCpuAccess::begin(42, DmaBufCpuAccess::Mode::write, "dma-buf fd 42");
    ASSERT_TRUE(guard) << guard.error().what();
    EXPECT_TRUE(guard->active());
  }
  ASSERT_EQ(SyncLog::flags.size(), 2u);
  EXPECT_EQ(SyncLog::flags[0], DMA_BUF_SYNC_START | DMA_BUF_SYNC_WRITE);
  EXPECT_EQ(SyncLog::flags[1], DMA_BUF_SYNC_END | DMA_BUF_SYNC_WRITE);
}

TEST(DmaBufCpuAccess, NamesTheBufferWhenTheStartIsRefused) {
  Fd memfd(::memfd_create("not-a-dmabuf", MFD_CLOEXEC));
  auto guard = DmaBufCpuAccess::begin(memfd.get(), DmaBufCpuAccess::Mode::read, "chunk 0 of the test");
  ASSERT_FALSE(guard);
  EXPECT_EQ(guard.error().errno_value(), ENOTTY);
  EXPECT_NE(guard.error().message().find("SYNC START on chunk 0 of the test"), std::string::npos);
}

}  // namespace
}  // namespace kvshare
