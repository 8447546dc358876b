#include "layout/remote_grant.h"

#include <gtest/gtest.h>

#include "remote_fixture.h"

namespace kvshare::layout {
namespace {

using testing::remote_example_header;

struct Grant {
  ShareHeader header;
  CellGrant cells(uint32_t n) const { return {&header.layout, &header.memory, n}; }
  const SharedTensor& k(uint32_t il) const { return *header.layout.find(0, il, TensorKind::k); }
  const SharedTensor& v(uint32_t il) const { return *header.layout.find(0, il, TensorKind::v); }
};

TEST(RemoteGrant, AcceptsTheRowsOfTheGrantedCellsOfEveryTensor) {
  Grant g{remote_example_header()};
  const SharedTensor& k1 = g.k(1);
  ASSERT_EQ(k1.tensor.row_bytes, 256u);
  EXPECT_TRUE(check_write(g.cells(10), k1.chunk, k1.offset, 10 * 256));
  EXPECT_TRUE(check_write(g.cells(10), k1.chunk, k1.offset + 9 * 256, 256));
}

TEST(RemoteGrant, RefusesAWriteThatRunsOneByteIntoTheFirstCellNotGranted) {
  Grant g{remote_example_header()};
  const SharedTensor& v0 = g.v(0);
  auto refused = check_write(g.cells(10), v0.chunk, v0.offset + 9 * 256, 257);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().errno_value(), EFAULT);
  EXPECT_NE(refused.error().message().find("outside cells 0..9 of cache_v_l0"), std::string::npos)
      << refused.error().message();
}

TEST(RemoteGrant, RefusesPaddingOtherChunksAndOffsetsThatWouldOverflow) {
  Grant g{remote_example_header()};
  const SharedTensor& k0 = g.k(0);
  const uint64_t chunk_bytes = g.header.layout.chunks[k0.chunk].size_bytes;
  EXPECT_EQ(check_write(g.cells(1), k0.chunk, chunk_bytes, 16).error().errno_value(), EFAULT);
  EXPECT_EQ(check_write(g.cells(1), k0.chunk + 7, 0, 16).error().errno_value(), EFAULT);
  EXPECT_EQ(check_write(g.cells(1), k0.chunk, k0.offset + 8, UINT64_MAX).error().errno_value(), EFAULT);
  EXPECT_EQ(check_write(g.cells(1), k0.chunk, UINT64_MAX, 2).error().errno_value(), EFAULT);
  EXPECT_EQ(check_write(g.cells(1), k0.chunk, k0.offset, 0).error().errno_value(), EINVAL);
}

TEST(RemoteGrant, RefusesMoreCellsThanTheCacheHasOrNone) {
  Grant g{remote_example_header()};
  EXPECT_EQ(check_grant(g.cells(0)).error().errno_value(), ERANGE);
  EXPECT_EQ(check_grant(g.cells(513)).error().errno_value(), ERANGE);
  EXPECT_TRUE(check_grant(g.cells(512)));
}

TEST(RemoteGrant, GivesOneRangePerTensorForCellMajorRows) {
  Grant g{remote_example_header()};
  const auto ranges = cell_ranges(g.header.layout, g.header.memory, 1, 3, 7);
  ASSERT_EQ(ranges.size(), 2u);
  EXPECT_EQ(ranges[0].offset, g.k(1).offset + 3 * 256);
  EXPECT_EQ(ranges[0].size_bytes, 4u * 256);
  EXPECT_EQ(ranges[1].offset, g.v(1).offset + 3 * 256);
  EXPECT_EQ(granted_bytes(g.header.layout, g.header.memory, 7), 2u * 2 * 7 * 256);
  for (const ChunkRange& r : ranges) EXPECT_TRUE(check_write(g.cells(7), r.chunk, r.offset, r.size_bytes));
}

TEST(RemoteGrant, SlicesEveryElementRowOfATransposedV) {
  Grant g{remote_example_header(512, false)};
  ASSERT_TRUE(g.header.memory.kv_caches[0].v_trans);
  const auto ranges = cell_ranges(g.header.layout, g.header.memory, 0, 0, 5);
  ASSERT_EQ(ranges.size(), 1u + 128u);  // K, then one slice per V element row
  const SharedTensor& v0 = g.v(0);
  const uint64_t element_row = 512 * 2;  // kv_size f16 elements: element j of cell c at (j*kv_size + c)*2
  EXPECT_EQ(ranges[2].offset, v0.offset + element_row);
  EXPECT_EQ(ranges[2].size_bytes, 5u * 2);
  EXPECT_EQ(granted_bytes(g.header.layout, g.header.memory, 5), 2u * 2 * 5 * 256);
  for (const ChunkRange& r : ranges) EXPECT_TRUE(check_write(g.cells(5), r.chunk, r.offset, r.size_bytes));
  // Cell 5 of element row 1 is not granted, nor is a write spanning two element rows.
  EXPECT_FALSE(check_write(g.cells(5), v0.chunk, v0.offset + element_row + 10, 2));
  EXPECT_FALSE(check_write(g.cells(5), v0.chunk, v0.offset + 8, element_row));
}

TEST(RemoteGrant, HashesTheWholeLayoutSoAnotherContextSizeDiffers) {
  EXPECT_EQ(whole_layout_hash(remote_example_header().layout), whole_layout_hash(remote_example_header().layout));
  EXPECT_NE(whole_layout_hash(remote_example_header(512).layout),
            whole_layout_hash(remote_example_header(1024).layout));
}

}  // namespace
}  // namespace kvshare::layout
