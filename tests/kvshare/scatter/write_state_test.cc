// kvshare::write_state and state_width: a recurrent layer's R or S row for one cell, on
// memories derived from GGUF metadata (mamba2: recurrent; lfm2: hybrid with a 0-wide S)
// and placed by layout::share_layout, in vector-backed chunks filled with a sentinel.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "kvshare/fd.h"
#include "kvshare/scatter/scatter.h"
#include "support/cache_fixture.h"
#include "support/recurrent_fixture.h"
#include "support/test_support.h"

namespace kvshare {
namespace {

using layout::TensorKind;
using testing::Region;

constexpr std::byte kFill{0xAB};

layout::MemoryShape mamba2(uint32_t n_seq_max = 3) { return testing::mamba2_memory(n_seq_max); }
layout::MemoryShape lfm2() { return testing::lfm2_memory(); }

std::vector<float> values_of(uint64_t n, float seed) {
  std::vector<float> values(n);
  for (uint64_t i = 0; i < n; ++i) values[i] = seed + static_cast<float>(i) / 8.0f;
  return values;
}

StateRow row_of(uint32_t il, TensorKind kind, uint32_t cell, const std::vector<float>& values) {
  return StateRow{il, kind, cell, values};
}

bool all_fill(std::span<const std::byte> bytes) {
  for (std::byte b : bytes)
    if (b != kFill) return false;
  return true;
}

bool untouched(const Region& region) {
  for (const auto& chunk : region.storage)
    if (!all_fill(chunk)) return false;
  return true;
}

// Every chunk holds kFill except row `cell` of `name`, which holds `values` byte for byte.
void expect_only_row(const Region& region, const std::string& name, uint32_t cell, const std::vector<float>& values) {
  const layout::SharedTensor* placed = region.layout.find(name);
  ASSERT_NE(placed, nullptr) << name;
  const uint64_t begin = placed->offset + cell * placed->tensor.row_bytes;
  const uint64_t end = begin + placed->tensor.row_bytes;
  ASSERT_EQ(placed->tensor.row_bytes, values.size() * sizeof(float));
  for (uint32_t c = 0; c < region.storage.size(); ++c) {
    const auto& bytes = region.storage[c];
    for (uint64_t b = 0; b < bytes.size(); ++b) {
      if (c == placed->chunk && b >= begin && b < end) continue;
      ASSERT_EQ(bytes[b], kFill) << "chunk " << c << " byte " << b;
    }
  }
  EXPECT_EQ(std::memcmp(region.storage[placed->chunk].data() + begin, values.data(), placed->tensor.row_bytes), 0);
}

TEST(StateWidth, GivesNEmbdRAndNEmbdSOfARecurrentLayer) {
  const Region region(mamba2());
  auto r = state_width(region.layout, region.memory, 1, TensorKind::r);
  auto s = state_width(region.layout, region.memory, 1, TensorKind::s);
  ASSERT_TRUE(r) << r.error().what();
  ASSERT_TRUE(s) << s.error().what();
  EXPECT_EQ(*r, 480u);
  EXPECT_EQ(*s, 2048u);
}

TEST(StateWidth, IsZeroForLfm2sS) {
  const Region region(lfm2());
  auto r = state_width(region.layout, region.memory, 2, TensorKind::r);
  auto s = state_width(region.layout, region.memory, 2, TensorKind::s);
  ASSERT_TRUE(r) << r.error().what();
  ASSERT_TRUE(s) << s.error().what();
  EXPECT_EQ(*r, 128u);
  EXPECT_EQ(*s, 0u);
}

TEST(StateWidth, RefusesAnAttentionLayerOfAHybridWithEnoentNamingTheRecurrentLayers) {
  const Region region(lfm2());
  auto width = state_width(region.layout, region.memory, 1, TensorKind::r);
  ASSERT_FALSE(width);
  EXPECT_EQ(width.error().errno_value(), ENOENT);
  EXPECT_NE(width.error().message().find("layer 1 has no cache_r_l1"), std::string::npos) << width.error().what();
  EXPECT_NE(width.error().message().find("(0, 2)"), std::string::npos) << width.error().what();
}

TEST(StateWidth, RefusesAMemoryWithoutRecurrentStateWithEnoent) {
  const Region region(testing::CacheSpec{{32}, {32}, 16});
  auto width = state_width(region.layout, region.memory, 0, TensorKind::s);
  ASSERT_FALSE(width);
  EXPECT_EQ(width.error().errno_value(), ENOENT);
  EXPECT_NE(width.error().message().find("has no recurrent state"), std::string::npos) << width.error().what();
}

TEST(StateWidth, RefusesKAndVWithEinval) {
  const Region region(mamba2());
  auto width = state_width(region.layout, region.memory, 0, TensorKind::k);
  ASSERT_FALSE(width);
  EXPECT_EQ(width.error().errno_value(), EINVAL);
  EXPECT_NE(width.error().message().find("state kind k"), std::string::npos) << width.error().what();
}

TEST(WriteState, PutsAnRRowAtExactlyItsCellsBytesAndNowhereElse) {
  Region region(mamba2());
  const auto values = values_of(480, 1.0f);
  auto written = write_state(region.target(), row_of(1, TensorKind::r, 1, values));
  ASSERT_TRUE(written) << written.error().what();
  expect_only_row(region, "cache_r_l1", 1, values);
}

TEST(WriteState, PutsAnSRowAtExactlyItsCellsBytesAndNowhereElse) {
  Region region(mamba2());
  const auto values = values_of(2048, -3.0f);
  auto written = write_state(region.target(), row_of(0, TensorKind::s, 2, values));
  ASSERT_TRUE(written) << written.error().what();
  expect_only_row(region, "cache_s_l0", 2, values);
}

TEST(WriteState, WritesCellZeroOfAHybridsConvLayer) {
  Region region(lfm2());
  const auto values = values_of(128, 0.5f);
  auto written = write_state(region.target(), row_of(2, TensorKind::r, 0, values));
  ASSERT_TRUE(written) << written.error().what();
  expect_only_row(region, "cache_r_l2", 0, values);
}

TEST(WriteState, AcceptsAnEmptyRowForLfm2sZeroWideSAndWritesNothing) {
  Region region(lfm2());
  auto written = write_state(region.target(), StateRow{0, TensorKind::s, 0, {}});
  ASSERT_TRUE(written) << written.error().what();
  EXPECT_TRUE(untouched(region));
}

TEST(WriteState, RefusesALayerPastTheModelNamingIt) {
  Region region(mamba2());
  const auto values = values_of(480, 1.0f);
  auto written = write_state(region.target(), row_of(7, TensorKind::r, 0, values));
  ASSERT_FALSE(written);
  EXPECT_EQ(written.error().errno_value(), EINVAL);
  EXPECT_NE(written.error().message().find("layer 7 has no cache_r_l7"), std::string::npos) << written.error().what();
  EXPECT_NE(written.error().message().find("2 recurrent layer(s) (0, 1)"), std::string::npos) << written.error().what();
  EXPECT_TRUE(untouched(region));
}

TEST(WriteState, RefusesAnAttentionLayerOfAHybrid) {
  Region region(lfm2());
  const auto values = values_of(128, 1.0f);
  auto written = write_state(region.target(), row_of(3, TensorKind::r, 0, values));
  ASSERT_FALSE(written);
  EXPECT_EQ(written.error().errno_value(), EINVAL);
  EXPECT_NE(written.error().message().find("layer 3 has no cache_r_l3"), std::string::npos) << written.error().what();
  EXPECT_TRUE(untouched(region));
}

TEST(WriteState, RefusesAPlainKvMemory) {
  Region region(testing::CacheSpec{{32}, {32}, 16});
  const auto values = values_of(32, 1.0f);
  auto written = write_state(region.target(), row_of(0, TensorKind::r, 0, values));
  ASSERT_FALSE(written);
  EXPECT_EQ(written.error().errno_value(), EINVAL);
  EXPECT_NE(written.error().message().find("the memory (kv) has no recurrent state"), std::string::npos)
      << written.error().what();
  EXPECT_TRUE(untouched(region));
}

TEST(WriteState, RefusesAKOrVKind) {
  Region region(mamba2());
  const auto values = values_of(480, 1.0f);
  auto written = write_state(region.target(), row_of(0, TensorKind::v, 0, values));
  ASSERT_FALSE(written);
  EXPECT_EQ(written.error().errno_value(), EINVAL);
  EXPECT_NE(written.error().message().find("state kind v is not r"), std::string::npos) << written.error().what();
  EXPECT_TRUE(untouched(region));
}

TEST(WriteState, RefusesACellPastRsSizeWithErange) {
  Region region(mamba2(3));
  const auto values = values_of(480, 1.0f);
  auto written = write_state(region.target(), row_of(0, TensorKind::r, 3, values));
  ASSERT_FALSE(written);
  EXPECT_EQ(written.error().errno_value(), ERANGE);
  EXPECT_NE(written.error().message().find("layer 0 cache_r_l0: cell 3 is past rs_size 3"), std::string::npos)
      << written.error().what();
  EXPECT_TRUE(untouched(region));
}

TEST(WriteState, RefusesARowOfAnotherWidthNamingTensorCellAndBothWidths) {
  Region region(mamba2());
  const auto values = values_of(2047, 1.0f);
  auto written = write_state(region.target(), row_of(1, TensorKind::s, 0, values));
  ASSERT_FALSE(written);
  EXPECT_EQ(written.error().errno_value(), EINVAL);
  EXPECT_NE(written.error().message().find("layer 1 cache_s_l1 cell 0: the provider's row carries 2047 values, the "
                                           "tensor's row holds 2048 (n_embd_s)"),
            std::string::npos)
      << written.error().what();
  EXPECT_TRUE(untouched(region));
}

TEST(WriteState, RefusesAChunkMappingShorterThanTheLayoutSays) {
  Region region(mamba2());
  ScatterTarget target = region.target();
  target.chunks.back() = target.chunks.back().first(4096);
  const auto values = values_of(2048, 1.0f);
  auto written = write_state(target, row_of(1, TensorKind::s, 0, values));
  ASSERT_FALSE(written);
  EXPECT_EQ(written.error().errno_value(), EINVAL);
  EXPECT_NE(written.error().message().find("cache_s_l1 needs bytes"), std::string::npos) << written.error().what();
  EXPECT_TRUE(untouched(region));
}

// The memfd path (ScatterTarget::chunk_files): the mapping handed in is MAP_PRIVATE, so the
// file holds exactly what went through the descriptor.
class WriteStateThroughFile : public kvshare::testing::FdLeakCheck {};

TEST_F(WriteStateThroughFile, WritesTheRowWithPwriteAndLeavesTheMappingAlone) {
  Region region(mamba2());
  std::vector<Fd> fds;
  std::vector<std::span<std::byte>> private_maps;
  std::vector<ChunkFile> files;
  for (uint32_t c = 0; c < region.layout.chunks.size(); ++c) {
    const uint64_t size = region.layout.chunks[c].size_bytes;
    Fd fd(::memfd_create("write-state-test", MFD_CLOEXEC));
    ASSERT_TRUE(fd.valid());
    ASSERT_EQ(::pwrite(fd.get(), region.storage[c].data(), size, 0), static_cast<ssize_t>(size));
    void* map = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd.get(), 0);
    ASSERT_NE(map, MAP_FAILED);
    std::memset(map, static_cast<int>(kFill), size);  // every page this mapping's own copy
    private_maps.emplace_back(static_cast<std::byte*>(map), size);
    files.push_back({fd.get(), 0, c});
    fds.push_back(std::move(fd));
  }
  const auto values = values_of(480, 2.0f);
  auto written = write_state(ScatterTarget{region.layout, region.memory, private_maps, 0, 0, 0, files},
                             row_of(0, TensorKind::r, 2, values));
  ASSERT_TRUE(written) << written.error().what();
  for (uint32_t c = 0; c < fds.size(); ++c) {
    EXPECT_TRUE(all_fill(private_maps[c])) << "chunk " << c;
    ASSERT_EQ(::pread(fds[c].get(), region.storage[c].data(), region.storage[c].size(), 0),
              static_cast<ssize_t>(region.storage[c].size()));
    ::munmap(private_maps[c].data(), private_maps[c].size());
  }
  expect_only_row(region, "cache_r_l0", 2, values);
}

}  // namespace
}  // namespace kvshare
