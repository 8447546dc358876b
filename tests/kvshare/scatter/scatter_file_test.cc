// kvshare::scatter writing position-major rows through a chunk's descriptor (pwrite) instead
// of the provider's mapping (ScatterTarget::chunk_files). The mapping a test hands in is
// MAP_PRIVATE, so bytes written through it never reach the memfd: what the memfd holds
// afterwards is exactly what went through the descriptor.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "kvshare/fd.h"
#include "kvshare/scatter/scatter.h"
#include "support/cache_fixture.h"
#include "support/test_support.h"

namespace kvshare {
namespace {

using layout::GgmlType;
using testing::CacheSpec;
using testing::make_rows;
using testing::Region;

constexpr std::byte kFill{0xAB};

// One memfd per chunk of the region's layout, filled with kFill, each mapped privately
// (copy-on-write, every page already copied).
struct MemfdRegion {
  explicit MemfdRegion(const Region& like) {
    for (const auto& chunk : like.layout.chunks) {
      Fd fd(::memfd_create("scatter-file-test", MFD_CLOEXEC));
      EXPECT_TRUE(fd.valid());
      EXPECT_EQ(::ftruncate(fd.get(), static_cast<off_t>(chunk.size_bytes)), 0);
      const std::vector<std::byte> fill(chunk.size_bytes, kFill);
      EXPECT_EQ(::pwrite(fd.get(), fill.data(), fill.size(), 0), static_cast<ssize_t>(fill.size()));
      void* map = ::mmap(nullptr, chunk.size_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd.get(), 0);
      EXPECT_NE(map, MAP_FAILED);
      // Writing every page makes it this mapping's own copy; an untouched private page
      // would still show what later reaches the file.
      std::memset(map, static_cast<int>(kFill), chunk.size_bytes);
      private_maps.emplace_back(static_cast<std::byte*>(map), chunk.size_bytes);
      fds.push_back(std::move(fd));
    }
  }
  ~MemfdRegion() {
    for (auto span : private_maps) ::munmap(span.data(), span.size());
  }
  ScatterTarget target(const Region& like) const {
    std::vector<ChunkFile> files;
    for (uint32_t i = 0; i < fds.size(); ++i) files.push_back({fds[i].get(), 0, i});
    return ScatterTarget{like.layout, like.memory, private_maps, 0, 0, 0, files};
  }
  std::vector<std::byte> file_bytes(uint32_t chunk) const {
    std::vector<std::byte> out(private_maps[chunk].size());
    EXPECT_EQ(::pread(fds[chunk].get(), out.data(), out.size(), 0), static_cast<ssize_t>(out.size()));
    return out;
  }
  std::vector<Fd> fds;
  std::vector<std::span<std::byte>> private_maps;
};

// Memfds, mappings and /proc/self/fd reopenings: each test must give back all it took.
class ScatterThroughFile : public testing::FdLeakCheck {};

bool all_fill(std::span<const std::byte> bytes) {
  for (std::byte b : bytes)
    if (b != kFill) return false;
  return true;
}

ScatterBatch batch_of(const testing::ProviderRows& rows, std::vector<uint32_t> layers, uint32_t n, uint32_t pos0,
                      uint32_t n_tokens) {
  ScatterBatch batch;
  for (uint32_t il : layers) batch.layers.push_back({il, rows.bytes.data(), n, n});
  batch.pos0 = pos0;
  batch.n_tokens = n_tokens;
  batch.src_type = GgmlType::F32;
  batch.row_stride = rows.row_stride;
  batch.n_threads = 2;
  return batch;
}

TEST_F(ScatterThroughFile, WritesTheSameBytesAsTheMappingAndNothingThroughTheMapping) {
  // 300 tokens cross the 256-token work item, so two items (two pwrites per tensor) meet.
  CacheSpec spec{{64, 64}, {64, 64}, 512};
  Region reference(spec);
  MemfdRegion region(reference);
  const auto rows = make_rows(300, 64, 64, GgmlType::F32, 21);
  const ScatterBatch batch = batch_of(rows, {0, 1}, 64, 7, 300);
  ASSERT_TRUE(scatter(reference.target(), batch));
  auto done = scatter(region.target(reference), batch);
  ASSERT_TRUE(done) << done.error().what();
  for (uint32_t c = 0; c < reference.layout.chunks.size(); ++c) {
    EXPECT_EQ(region.file_bytes(c), reference.storage[c]) << "chunk " << c;
    EXPECT_TRUE(all_fill(region.private_maps[c])) << "chunk " << c << " was written through the mapping";
  }
}

TEST_F(ScatterThroughFile, KeepsTheMappingForATransposedV) {
  CacheSpec spec{{32, 32}, {32, 32}, 64, 1, GgmlType::F16, GgmlType::F16, true};
  Region reference(spec);
  MemfdRegion region(reference);
  const auto rows = make_rows(5, 32, 32, GgmlType::F32, 4);
  const ScatterBatch batch = batch_of(rows, {1}, 32, 3, 5);
  ASSERT_TRUE(scatter(reference.target(), batch));
  ASSERT_TRUE(scatter(region.target(reference), batch));
  const layout::SharedTensor* k = reference.layout.find("cache_k_l1");
  const layout::SharedTensor* v = reference.layout.find("cache_v_l1");
  const auto file = region.file_bytes(k->chunk);
  const std::byte* expected_k = reference.tensor("cache_k_l1");
  EXPECT_EQ(std::memcmp(file.data() + k->offset, expected_k, k->tensor.nbytes), 0);
  EXPECT_TRUE(all_fill(std::span(file.data() + v->offset, v->tensor.nbytes)));
  EXPECT_EQ(
      std::memcmp(region.private_maps[v->chunk].data() + v->offset, reference.tensor("cache_v_l1"), v->tensor.nbytes),
      0);
}

TEST_F(ScatterThroughFile, UsesTheMappingForAChunkWithoutADescriptor) {
  CacheSpec spec{{32}, {32}, 64};
  Region reference(spec);
  MemfdRegion region(reference);
  const auto rows = make_rows(4, 32, 32, GgmlType::F32, 5);
  const ScatterBatch batch = batch_of(rows, {0}, 32, 0, 4);
  ASSERT_TRUE(scatter(reference.target(), batch));
  ScatterTarget target = region.target(reference);
  for (auto& file : target.chunk_files) file.fd = -1;  // a dma-buf chunk: no write(2)
  ASSERT_TRUE(scatter(target, batch));
  EXPECT_EQ(std::memcmp(region.private_maps[0].data(), reference.storage[0].data(), reference.storage[0].size()), 0);
  EXPECT_TRUE(all_fill(region.file_bytes(0)));
}

TEST_F(ScatterThroughFile, RefusesADescriptorListOfAnotherLength) {
  CacheSpec spec{{32}, {32}, 64};
  Region reference(spec);
  MemfdRegion region(reference);
  const auto rows = make_rows(2, 32, 32, GgmlType::F32, 6);
  ScatterTarget target = region.target(reference);
  target.chunk_files.push_back({});
  auto done = scatter(target, batch_of(rows, {0}, 32, 0, 2));
  ASSERT_FALSE(done);
  EXPECT_EQ(done.error().errno_value(), EINVAL);
  EXPECT_NE(done.error().message().find("chunk descriptors"), std::string::npos) << done.error().what();
  EXPECT_TRUE(all_fill(region.file_bytes(0)));
}

TEST_F(ScatterThroughFile, NamesTheLayerAndChunkWhenAWriteFails) {
  CacheSpec spec{{32}, {32}, 64};
  Region reference(spec);
  MemfdRegion region(reference);
  const auto rows = make_rows(2, 32, 32, GgmlType::F32, 7);
  ScatterTarget target = region.target(reference);
  Fd read_only(::open(fmt::format("/proc/self/fd/{}", region.fds[0].get()).c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(read_only.valid());
  target.chunk_files[0].fd = read_only.get();
  auto done = scatter(target, batch_of(rows, {0}, 32, 0, 2));
  ASSERT_FALSE(done);
  EXPECT_EQ(done.error().errno_value(), EBADF);
  EXPECT_NE(done.error().message().find("layer 0 cache_k_l0"), std::string::npos) << done.error().what();
  EXPECT_NE(done.error().message().find("chunk 0"), std::string::npos) << done.error().what();
}

}  // namespace
}  // namespace kvshare
