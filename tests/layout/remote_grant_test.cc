#include "layout/remote_grant.h"

#include <gtest/gtest.h>

#include <fmt/format.h>

#include "remote_fixture.h"

namespace kvshare::layout {
namespace {

using testing::remote_example_header;

struct Grant {
  ShareHeader header;
  CellGrant cells(uint32_t n) const { return {&header.layout, &header.memory, 0, 0, n}; }
  CellGrant range(uint32_t stream, uint32_t begin, uint32_t end) const {
    return {&header.layout, &header.memory, stream, begin, end};
  }
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
  EXPECT_NE(refused.error().message().find("outside cells 0..9 of stream 0 of cache_v_l0"), std::string::npos)
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
  const auto ranges = cell_ranges(g.header.layout, g.header.memory, 1, 0, 3, 7);
  ASSERT_EQ(ranges.size(), 2u);
  EXPECT_EQ(ranges[0].offset, g.k(1).offset + 3 * 256);
  EXPECT_EQ(ranges[0].size_bytes, 4u * 256);
  EXPECT_EQ(ranges[1].offset, g.v(1).offset + 3 * 256);
  EXPECT_EQ(granted_bytes(g.cells(7)), 2u * 2 * 7 * 256);
  for (const ChunkRange& r : ranges) EXPECT_TRUE(check_write(g.cells(7), r.chunk, r.offset, r.size_bytes));
}

TEST(RemoteGrant, SlicesEveryElementRowOfATransposedV) {
  Grant g{remote_example_header(512, false)};
  ASSERT_TRUE(g.header.memory.kv_caches[0].v_trans);
  const auto ranges = cell_ranges(g.header.layout, g.header.memory, 0, 0, 0, 5);
  ASSERT_EQ(ranges.size(), 1u + 128u);  // K, then one slice per V element row
  const SharedTensor& v0 = g.v(0);
  const uint64_t element_row = 512 * 2;  // kv_size f16 elements: element j of cell c at (j*kv_size + c)*2
  EXPECT_EQ(ranges[2].offset, v0.offset + element_row);
  EXPECT_EQ(ranges[2].size_bytes, 5u * 2);
  EXPECT_EQ(granted_bytes(g.cells(5)), 2u * 2 * 5 * 256);
  for (const ChunkRange& r : ranges) EXPECT_TRUE(check_write(g.cells(5), r.chunk, r.offset, r.size_bytes));
  // Cell 5 of element row 1 is not granted, nor is a write spanning two element rows.
  EXPECT_FALSE(check_write(g.cells(5), v0.chunk, v0.offset + element_row + 10, 2));
  EXPECT_FALSE(check_write(g.cells(5), v0.chunk, v0.offset + 8, element_row));
}

// -np 4 without --kv-unified: four streams of 512 cells; slot s decodes from stream s.
ShareHeader four_streams(bool flash_attn = true) { return remote_example_header(2048, flash_attn, 4); }

TEST(RemoteGrant, GrantsARangeOfStream1Of4NotStartingAtCell0) {
  Grant g{four_streams()};
  ASSERT_EQ(g.header.memory.kv_caches[0].n_stream, 4u);
  ASSERT_EQ(g.header.memory.kv_caches[0].kv_size, 512u);
  const CellGrant grant = g.range(1, 100, 110);
  ASSERT_TRUE(check_grant(grant));
  const uint64_t stream_bytes = 512 * 256;
  const auto ranges = cell_ranges(g.header.layout, g.header.memory, 1, 1, 100, 110);
  ASSERT_EQ(ranges.size(), 2u);
  EXPECT_EQ(ranges[0].offset, g.k(1).offset + stream_bytes + 100 * 256);
  EXPECT_EQ(ranges[0].size_bytes, 10u * 256);
  EXPECT_EQ(ranges[1].offset, g.v(1).offset + stream_bytes + 100 * 256);
  EXPECT_EQ(granted_bytes(grant), 2u * 2 * 10 * 256);
  for (const ChunkRange& r : ranges) EXPECT_TRUE(check_write(grant, r.chunk, r.offset, r.size_bytes));
}

TEST(RemoteGrant, RefusesAWriteOneRowBeforeOrAfterTheRangeOrIntoAnotherStream) {
  Grant g{four_streams()};
  const CellGrant grant = g.range(1, 100, 110);
  const SharedTensor& k0 = g.k(0);
  const uint64_t stream1 = k0.offset + 512 * 256;
  auto before = check_write(grant, k0.chunk, stream1 + 99 * 256, 256);
  ASSERT_FALSE(before);
  EXPECT_EQ(before.error().errno_value(), EFAULT);
  EXPECT_NE(before.error().message().find("outside cells 100..109 of stream 1 of cache_k_l0"), std::string::npos)
      << before.error().message();
  auto after = check_write(grant, k0.chunk, stream1 + 110 * 256, 256);
  ASSERT_FALSE(after);
  EXPECT_EQ(after.error().errno_value(), EFAULT);
  // The last granted row and one more: it runs past cell_end.
  EXPECT_EQ(check_write(grant, k0.chunk, stream1 + 109 * 256, 512).error().errno_value(), EFAULT);
  // The same cells of stream 2 (another slot's) and of stream 0.
  for (uint64_t other : {0u, 2u}) {
    auto refused = check_write(grant, k0.chunk, k0.offset + other * 512 * 256 + 100 * 256, 256);
    ASSERT_FALSE(refused);
    EXPECT_EQ(refused.error().errno_value(), EFAULT);
    EXPECT_NE(refused.error().message().find(fmt::format("into stream {} of cache_k_l0, the grant is stream 1", other)),
              std::string::npos)
        << refused.error().message();
  }
}

TEST(RemoteGrant, SlicesEveryElementRowOfATransposedVOfItsOwnStream) {
  Grant g{four_streams(false)};
  const KvCacheShape& cache = g.header.memory.kv_caches[0];
  ASSERT_TRUE(cache.v_trans);
  const CellGrant grant = g.range(2, 7, 12);
  const SharedTensor& v0 = g.v(0);
  const uint64_t element_row = 512 * 2;                                  // kv_size f16 elements
  const uint64_t stream2 = v0.offset + 2 * cache.v_width * element_row;  // v_width element rows a stream
  const auto ranges = cell_ranges(g.header.layout, g.header.memory, 0, 2, 7, 12);
  ASSERT_EQ(ranges.size(), 1u + 128u);
  EXPECT_EQ(ranges[1].offset, stream2 + 7 * 2);
  EXPECT_EQ(ranges[2].offset, stream2 + element_row + 7 * 2);
  EXPECT_EQ(ranges[2].size_bytes, 5u * 2);
  EXPECT_EQ(granted_bytes(grant), 2u * 2 * 5 * 256);
  for (const ChunkRange& r : ranges) EXPECT_TRUE(check_write(grant, r.chunk, r.offset, r.size_bytes));
  EXPECT_FALSE(check_write(grant, v0.chunk, stream2 + element_row + 6 * 2, 2));    // cell 6
  EXPECT_FALSE(check_write(grant, v0.chunk, stream2 + element_row + 12 * 2, 2));   // cell 12
  EXPECT_FALSE(check_write(grant, v0.chunk, v0.offset + element_row + 7 * 2, 2));  // stream 0
}

TEST(RemoteGrant, RefusesAStreamPastTheCacheAndARangePastKvSize) {
  Grant g{four_streams()};
  auto stream = check_grant(g.range(4, 0, 1));
  ASSERT_FALSE(stream);
  EXPECT_EQ(stream.error().errno_value(), EINVAL);
  EXPECT_NE(stream.error().message().find("stream 4, the KV cache has 4 stream(s)"), std::string::npos);
  EXPECT_EQ(check_grant(g.range(0, 500, 513)).error().errno_value(), ERANGE);
  EXPECT_EQ(check_grant(g.range(0, 5, 5)).error().errno_value(), ERANGE);
  EXPECT_TRUE(check_grant(g.range(3, 500, 512)));
}

TEST(RemoteGrant, GrantCellsSkipsTheCachedPositionsAndRefusesOverflow) {
  Grant g{four_streams()};
  auto grant = grant_cells(g.header.layout, g.header.memory, 3, 64, 10, 30);
  ASSERT_TRUE(grant) << grant.error().what();
  EXPECT_EQ(grant->stream, 3u);
  EXPECT_EQ(grant->cell_begin, 74u);
  EXPECT_EQ(grant->cell_end, 94u);
  EXPECT_EQ(grant_cells(g.header.layout, g.header.memory, 0, 0, 30, 30).error().errno_value(), EINVAL);
  EXPECT_EQ(grant_cells(g.header.layout, g.header.memory, 0, UINT32_MAX, 0, 2).error().errno_value(), ERANGE);
  EXPECT_EQ(grant_cells(g.header.layout, g.header.memory, 0, 500, 0, 13).error().errno_value(), ERANGE);
  // A write check near the top of the 64-bit range does not wrap into the grant.
  const CellGrant top = g.range(3, 500, 512);
  EXPECT_EQ(check_write(top, g.k(1).chunk, UINT64_MAX - 1, 2).error().errno_value(), EFAULT);
  EXPECT_EQ(check_write(top, g.k(1).chunk, g.k(1).offset + 3 * 512 * 256 + 511 * 256, UINT64_MAX).error().errno_value(),
            EFAULT);
}

TEST(RemoteGrant, RefusesAnISwaMemoryByName) {
  ShareHeader header = remote_example_header();
  header.memory.kv_caches.push_back(header.memory.kv_caches.front());
  auto refused = check_grant({&header.layout, &header.memory, 0, 0, 1});
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().errno_value(), EINVAL);
  EXPECT_NE(refused.error().message().find("2 KV cache object(s)"), std::string::npos);
}

TEST(RemoteGrant, HashesTheWholeLayoutSoAnotherContextSizeDiffers) {
  EXPECT_EQ(whole_layout_hash(remote_example_header().layout), whole_layout_hash(remote_example_header().layout));
  EXPECT_NE(whole_layout_hash(remote_example_header(512).layout),
            whole_layout_hash(remote_example_header(1024).layout));
}

}  // namespace
}  // namespace kvshare::layout
