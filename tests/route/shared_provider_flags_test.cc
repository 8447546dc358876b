// What serve tells a per-request provider of the decoder's share (issue #27): the stream
// and the run of cells only when the share named them, so older providers keep serving.
#include <gtest/gtest.h>

#include "kvshare/share/broker.h"
#include "route/handoff.h"

namespace kvshare::route {
namespace {

using Flags = std::vector<std::string>;

TEST(SharedProviderFlags, NameTheStreamAndTheCellsOnlyWhenTheShareNamedThem) {
  ReceivedShare share;
  EXPECT_EQ(shared_provider_flags(share, 0), Flags{});
  EXPECT_EQ(shared_provider_flags(share, 3), (Flags{"--cached", "3"}));
  share.stream = 2;
  EXPECT_EQ(shared_provider_flags(share, 0), (Flags{"--stream", "2"}));
  share.stream = 0;
  share.first_cell = 100;
  share.n_cells = 40;
  EXPECT_EQ(shared_provider_flags(share, 0), (Flags{"--first-cell", "100", "--cells", "40"}));
}

TEST(SharedProviderFlags, ARunOfCellsShorterThanTheIdsTakesTheFileRoute) {
  ReceivedShare share;
  EXPECT_EQ(share_range_shortfall(share, 5000), "");  // no range: the whole stream
  share.first_cell = 100;
  share.n_cells = 40;
  EXPECT_EQ(share_range_shortfall(share, 40), "");
  EXPECT_EQ(share_range_shortfall(share, 41),
            "the share names cells 100..139 of stream 0 (40 cells), fewer than the 41 tokens handed over");
}

}  // namespace
}  // namespace kvshare::route
