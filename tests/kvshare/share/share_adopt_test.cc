// The whole zero-copy handoff with two real processes: this test is the decoder and the
// broker; kvshare-test-child-provider, started by the broker with the fds inherited, is
// the provider.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

#include <optional>

#include "kvshare/share/broker.h"
#include "kvshare/share/decoder_share.h"
#include "layout/model_shape.h"
#include "layout/shape_fixtures.h"
#include "share_fixtures.h"
#include "support/test_support.h"

namespace kvshare {
namespace {

using testing::FdLeakCheck;
namespace fs = std::filesystem;

ExportOptions memfd_only() {
  ExportOptions options;
  options.forced = RegionBackend::memfd;
  return options;
}

std::vector<std::string> provider_argv(uint64_t n_tokens, const std::string& type_k = "f16") {
  return {testing::tool_path("kvshare-test-child-provider").string(),
          "--layout",
          "{layout}",
          "--fds",
          "{fds}",
          "--tokens",
          std::to_string(n_tokens),
          "--type-k",
          type_k};
}

class ShareAdopt : public FdLeakCheck {};

TEST_F(ShareAdopt, DecoderReadsTheProvidersWritesThroughItsOwnMappingAfterAdopt) {
  constexpr uint64_t kTokens = 5;
  auto decoder = DecoderShare::start(testing::small_share_header(), true, memfd_only());
  ASSERT_TRUE(decoder.can_share()) << decoder.startup_warning();
  // Before: the cache reads as zero.
  auto k0 = decoder.view("cache_k_l0");
  ASSERT_TRUE(k0) << k0.error().what();
  ASSERT_EQ(k0->row(0)[0], std::byte{0});

  auto broker = ShareBroker::listen();  // 1. listen
  ASSERT_TRUE(broker) << broker.error().what();
  auto share_id = decoder.share(broker->socket_path(), 0, 2000);  // 2. share
  ASSERT_TRUE(share_id) << share_id.error().what();
  auto share = broker->receive(2000);  // 3. fds
  ASSERT_TRUE(share) << share.error().what();
  EXPECT_EQ(share->share_id, *share_id);
  EXPECT_EQ(share->peer.pid, ::getpid());
  ASSERT_EQ(share->fds.size(), decoder.regions().size());

  auto run = broker->run_provider(*share, provider_argv(kTokens), 20000);  // 4. provider
  ASSERT_TRUE(run) << run.error().what();
  ASSERT_EQ(run->status.describe(), "exit code 0") << run->err;
  EXPECT_EQ(run->last_stdout_line(), "child provider: wrote 5120 bytes into 4 tensors");

  auto plan = decoder.adopt(kTokens, *share_id);  // 5. adopt
  ASSERT_TRUE(plan) << plan.error().what();
  EXPECT_EQ(plan->n_tokens, kTokens);

  // The decoder's own mapping, never written by this process, holds the provider's bytes:
  // the pages are shared, nothing was copied.
  for (uint32_t il = 0; il < 2; ++il) {
    auto layer = decoder.layer(0, il);
    ASSERT_TRUE(layer) << layer.error().what();
    for (bool is_v : {false, true}) {
      const auto& view = is_v ? layer->v : layer->k;
      for (uint64_t row = 0; row < kTokens; ++row)
        for (uint64_t column = 0; column < view.row_bytes; ++column)
          ASSERT_EQ(static_cast<unsigned char>(view.row(row)[column]), testing::pattern_byte(il, is_v, row, column))
              << view.name() << " row " << row << " column " << column;
      EXPECT_EQ(view.row(kTokens)[0], std::byte{0}) << "row past the prompt was touched in " << view.name();
    }
  }
}

// LFM2's short-conv layers have a conv state and no SSM state: cache_s_l<il> is 0 wide and
// 0 bytes. The decoder refused such a tensor ("0 bytes is not a whole number of 0-byte
// rows"), so llama-server declined the region after placing the attention cache in it.
TEST_F(ShareAdopt, ADecoderViewsAStateOfWidthZeroAsNoBytes) {
  auto lfm2 = layout::testing::transformer("lfm2", 2, 256, 4, 2);
  lfm2.set("attention.head_count_kv", layout::testing::u32_array({0, 2})).u32("shortconv.l_cache", 3);
  auto shape = layout::derive_model_shape(lfm2.metadata());
  ASSERT_TRUE(shape) << shape.error().what();
  auto header = layout::make_share_header(layout::ModelFingerprint{"lfm2"}, *shape, layout::KvParams{});
  ASSERT_TRUE(header) << header.error().what();
  auto decoder = DecoderShare::start(*header, true, memfd_only());
  ASSERT_TRUE(decoder.can_share()) << decoder.startup_warning();
  auto s0 = decoder.view("cache_s_l0");
  ASSERT_TRUE(s0) << s0.error().what();
  EXPECT_EQ(s0->size_bytes(), 0u);
  EXPECT_EQ(s0->rows, 1u);
  auto r0 = decoder.view("cache_r_l0");
  ASSERT_TRUE(r0) << r0.error().what();
  EXPECT_EQ(r0->row_bytes, 256u * 2u * 4u);  // n_embd x (l_cache - 1) f32
}

TEST_F(ShareAdopt, ParsesADecodersHeaderOnceAndKnowsItsBytesAfterwards) {
  ShareBroker::forget_known_header();
  auto decoder = DecoderShare::start(testing::small_share_header(), true, memfd_only());
  ASSERT_TRUE(decoder.can_share()) << decoder.startup_warning();
  std::optional<layout::ShareHeader> first_header;
  for (int round = 0; round < 3; ++round) {
    auto broker = ShareBroker::listen();
    ASSERT_TRUE(broker) << broker.error().what();
    ASSERT_TRUE(decoder.share(broker->socket_path(), 0, 2000));
    auto share = broker->receive(2000);
    ASSERT_TRUE(share) << share.error().what();
    EXPECT_EQ(share->header_was_known, round > 0) << "round " << round;
    EXPECT_EQ(layout::to_json(share->header), layout::to_json(decoder.header())) << "round " << round;
    EXPECT_EQ(share->fds.size(), share->header.layout.chunks.size());
  }
  // Another decoder's header (other KV params) is not the known one: parsed in full.
  auto other_decoder = DecoderShare::start(testing::small_share_header(512), true, memfd_only());
  ASSERT_TRUE(other_decoder.can_share()) << other_decoder.startup_warning();
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker) << broker.error().what();
  ASSERT_TRUE(other_decoder.share(broker->socket_path(), 0, 2000));
  auto share = broker->receive(2000);
  ASSERT_TRUE(share) << share.error().what();
  EXPECT_FALSE(share->header_was_known);
  EXPECT_EQ(share->header.params.n_ctx, 512u);
}

TEST_F(ShareAdopt, PassesOnlyTheToldDescriptorsToTheProvider) {
  // A descriptor this process opened without O_CLOEXEC must still not reach the child
  // (the child exits 3 naming any extra descriptor).
  const int leaky = ::open("/dev/null", O_RDONLY);
  ASSERT_GE(leaky, 0);
  Fd leaky_owner(leaky);
  auto decoder = DecoderShare::start(testing::small_share_header(), true, memfd_only());
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  ASSERT_TRUE(decoder.share(broker->socket_path(), 0, 2000));
  auto share = broker->receive(2000);
  ASSERT_TRUE(share) << share.error().what();
  auto run = broker->run_provider(*share, provider_argv(1), 20000);
  ASSERT_TRUE(run) << run.error().what();
  EXPECT_EQ(run->status.describe(), "exit code 0") << run->err;
}

TEST_F(ShareAdopt, CleansUpTheHeaderFileAndTheSocket) {
  auto decoder = DecoderShare::start(testing::small_share_header(), true, memfd_only());
  fs::path directory;
  std::string socket_path;
  {
    auto broker = ShareBroker::listen();
    ASSERT_TRUE(broker);
    directory = broker->directory();
    socket_path = broker->socket_path();
    ASSERT_TRUE(decoder.share(socket_path, 0, 2000));
    auto share = broker->receive(2000);
    ASSERT_TRUE(share) << share.error().what();
    auto run = broker->run_provider(*share, provider_argv(1), 20000);
    ASSERT_TRUE(run) << run.error().what();
    // Only the socket is left once the provider has run.
    size_t entries = 0;
    for ([[maybe_unused]] const auto& entry : fs::directory_iterator(directory)) ++entries;
    EXPECT_EQ(entries, 1u);
  }
  EXPECT_FALSE(fs::exists(socket_path));
  EXPECT_FALSE(fs::exists(directory));
}

TEST_F(ShareAdopt, ProviderRefusesAHeaderWithOtherKvTypesNamingTheField) {
  auto decoder = DecoderShare::start(testing::small_share_header(), true, memfd_only());
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  ASSERT_TRUE(decoder.share(broker->socket_path(), 0, 2000));
  auto share = broker->receive(2000);
  ASSERT_TRUE(share) << share.error().what();
  auto run = broker->run_provider(*share, provider_argv(1, "q8_0"), 20000);
  ASSERT_TRUE(run) << run.error().what();
  EXPECT_EQ(run->status.describe(), "exit code 1");
  EXPECT_NE(run->err.find("params.type_k"), std::string::npos) << run->err;
}

TEST_F(ShareAdopt, ShareFailsWhenNobodyListens) {
  testing::TempDir dir;
  auto decoder = DecoderShare::start(testing::small_share_header(), true, memfd_only());
  auto share_id = decoder.share((dir / "share.sock").string(), 0, 200);
  ASSERT_FALSE(share_id);
  EXPECT_EQ(share_id.error().errno_value(), ENOENT);
  EXPECT_EQ(http_status_for(share_id.error()), 500);
}

TEST_F(ShareAdopt, RefusesAStaleShareId) {
  auto decoder = DecoderShare::start(testing::small_share_header(), true, memfd_only());
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  auto first = decoder.share(broker->socket_path(), 0, 2000);
  auto second = decoder.share(broker->socket_path(), 0, 2000);
  ASSERT_TRUE(first && second);
  EXPECT_GT(*second, *first);
  auto stale = decoder.adopt(3, *first);
  ASSERT_FALSE(stale);
  EXPECT_EQ(stale.error().errno_value(), ESTALE);
  EXPECT_NE(stale.error().message().find(fmt::format("share_id {}: it is stale, the later share {} of stream 0 (the "
                                                     "whole stream) overlaps its own (the whole stream)",
                                                     *first, *second)),
            std::string::npos)
      << stale.error().message();
  EXPECT_EQ(http_status_for(stale.error()), 409);
  ASSERT_TRUE(decoder.adopt(3, *second));
  auto again = decoder.adopt(3, *second);
  ASSERT_FALSE(again);
  EXPECT_NE(again.error().message().find("already adopted"), std::string::npos);
}

TEST_F(ShareAdopt, RefusesMoreTokensThanTheCacheHolds) {
  auto decoder = DecoderShare::start(testing::small_share_header(256), true, memfd_only());
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  auto id = decoder.share(broker->socket_path(), 0, 2000);
  ASSERT_TRUE(id);
  auto plan = decoder.adopt(257, *id);
  ASSERT_FALSE(plan);
  EXPECT_EQ(plan.error().errno_value(), ERANGE);
  EXPECT_NE(plan.error().message().find("257 tokens do not fit the \"kv\" KV cache of 256 cells"), std::string::npos)
      << plan.error().message();
  EXPECT_EQ(decoder.adopt(0, *id).error().errno_value(), EINVAL);
}

TEST_F(ShareAdopt, RefusesAdoptBeforeAnyShare) {
  auto decoder = DecoderShare::start(testing::small_share_header(), true, memfd_only());
  auto plan = decoder.adopt(1, 1);
  ASSERT_FALSE(plan);
  EXPECT_EQ(plan.error().errno_value(), ESTALE);
  EXPECT_NE(plan.error().message().find("no share has been made"), std::string::npos);
}

// Issue #27: with one stream per slot, a share of one slot made every other slot's share
// stale, so two slots could not hand over at once.
TEST_F(ShareAdopt, AShareOfOneStreamStalesOnlyThatStreamsEarlierShares) {
  auto decoder = DecoderShare::start(testing::three_stream_share_header(), true, memfd_only());
  ASSERT_TRUE(decoder.can_share()) << decoder.startup_warning();
  ASSERT_EQ(decoder.n_stream(), 3u);
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  auto s0 = decoder.share(broker->socket_path(), 0, 2000);
  auto s1 = decoder.share(broker->socket_path(), 1, 2000);
  ASSERT_TRUE(s0 && s1);
  EXPECT_GT(*s1, *s0);  // ids increase across streams
  EXPECT_EQ(decoder.latest_share_id(), *s1);
  EXPECT_EQ(decoder.latest_share_id(0), *s0);
  auto plan0 = decoder.adopt(3, *s0, 0);
  ASSERT_TRUE(plan0) << plan0.error().what();
  EXPECT_EQ(plan0->stream, 0u);
  auto plan1 = decoder.adopt(3, *s1, 1);
  ASSERT_TRUE(plan1) << plan1.error().what();
  EXPECT_EQ(plan1->stream, 1u);

  auto s0_again = decoder.share(broker->socket_path(), 0, 2000);
  auto s1_again = decoder.share(broker->socket_path(), 1, 2000);
  auto s0_third = decoder.share(broker->socket_path(), 0, 2000);
  ASSERT_TRUE(s0_again && s1_again && s0_third);
  auto stale = decoder.adopt(3, *s0_again, 0);
  ASSERT_FALSE(stale);
  EXPECT_EQ(stale.error().errno_value(), ESTALE);
  EXPECT_NE(stale.error().message().find("of stream 0"), std::string::npos) << stale.error().what();
  EXPECT_TRUE(decoder.adopt(3, *s1_again, 1)) << "a share of stream 0 made stream 1's share stale";
  EXPECT_TRUE(decoder.adopt(3, *s0_third, 0));
}

TEST_F(ShareAdopt, RefusesAdoptOfAnotherStreamsShareNamingBothStreams) {
  auto decoder = DecoderShare::start(testing::three_stream_share_header(), true, memfd_only());
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  auto s2 = decoder.share(broker->socket_path(), 2, 2000);
  ASSERT_TRUE(s2) << s2.error().what();
  auto wrong = decoder.adopt(3, *s2, 1);
  ASSERT_FALSE(wrong);
  EXPECT_EQ(wrong.error().errno_value(), EINVAL);
  EXPECT_NE(wrong.error().message().find("into stream 1: that share was made for stream 2"), std::string::npos)
      << wrong.error().what();
  auto past = decoder.adopt(3, *s2, 3);
  ASSERT_FALSE(past);
  EXPECT_EQ(past.error().errno_value(), EINVAL);
  EXPECT_TRUE(decoder.adopt(3, *s2, 2));  // the refusals left it adoptable
}

TEST_F(ShareAdopt, RefusesAStreamPastNStreamBeforeConnecting) {
  testing::TempDir dir;
  auto decoder = DecoderShare::start(testing::three_stream_share_header(), true, memfd_only());
  auto id = decoder.share((dir / "nobody.sock").string(), 3, 100);  // nobody listens: refused first
  ASSERT_FALSE(id);
  EXPECT_EQ(id.error().errno_value(), EINVAL);
  EXPECT_NE(id.error().message().find("share of stream 3: the \"kv\" KV cache has n_stream 3"), std::string::npos)
      << id.error().what();
  EXPECT_EQ(decoder.latest_share_id(), 0u);  // no id spent
  auto single = DecoderShare::start(testing::small_share_header(), true, memfd_only());
  auto one = single.share((dir / "nobody.sock").string(), 1, 100);
  ASSERT_FALSE(one);
  EXPECT_EQ(one.error().errno_value(), EINVAL);
  EXPECT_NE(one.error().message().find("n_stream 1"), std::string::npos) << one.error().what();
}

TEST_F(ShareAdopt, RefusesAUnifiedCacheOfSeveralSlotsForTheFileRoute) {
  testing::TempDir dir;
  auto header = testing::small_share_header(512, layout::GgmlType::F16, 2, 2, true);
  ASSERT_EQ(header.memory.kv_caches.front().n_stream, 1u);
  auto decoder = DecoderShare::start(header, true, memfd_only());
  auto id = decoder.share((dir / "nobody.sock").string(), 0, 100);
  ASSERT_FALSE(id);
  EXPECT_EQ(id.error().errno_value(), ENOTSUP);
  EXPECT_EQ(http_status_for(id.error()), 501);
  EXPECT_NE(id.error().message().find("a unified KV cache"), std::string::npos) << id.error().what();
  EXPECT_NE(id.error().message().find("without --kv-unified"), std::string::npos) << id.error().what();
  EXPECT_NE(id.error().message().find("the file route serves this slot"), std::string::npos);
  EXPECT_NE(id.error().message().find("name the cells reserved for the sequence"), std::string::npos)
      << id.error().what();
  EXPECT_EQ(decoder.latest_share_id(), 0u);
}

// Issue #27, a unified cache (llama-server's -np auto): every slot's cells in one stream,
// so the decoder reserves a run of cells for the sequence and the share names it.
layout::ShareHeader unified_three_slot_header() {
  return testing::small_share_header(512, layout::GgmlType::F16, 2, 3, true);
}

TEST_F(ShareAdopt, AShareOfARunOfCellsOfAUnifiedCacheReachesTheBroker) {
  auto header = unified_three_slot_header();
  ASSERT_EQ(header.memory.kv_caches.front().n_stream, 1u);
  ASSERT_EQ(header.memory.kv_caches.front().kv_size, 512u);
  auto decoder = DecoderShare::start(header, true, memfd_only());
  ASSERT_TRUE(decoder.can_share()) << decoder.startup_warning();
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  auto id = decoder.share(broker->socket_path(), ShareCells{0, 100, 40}, 2000);
  ASSERT_TRUE(id) << id.error().what();
  auto share = broker->receive(2000);
  ASSERT_TRUE(share) << share.error().what();
  EXPECT_EQ(share->share_id, *id);
  EXPECT_EQ(share->stream, 0u);
  EXPECT_EQ(share->first_cell, 100u);
  EXPECT_EQ(share->n_cells, 40u);

  auto too_many = decoder.adopt(41, *id, 0);
  ASSERT_FALSE(too_many);
  EXPECT_EQ(too_many.error().errno_value(), ERANGE);
  EXPECT_NE(too_many.error().message().find("41 tokens do not fit the share's n_cells 40"), std::string::npos)
      << too_many.error().what();
  auto plan = decoder.adopt(40, *id, 0);
  ASSERT_TRUE(plan) << plan.error().what();
  EXPECT_EQ(plan->first_cell, 100u);
  EXPECT_EQ(plan->n_cells, 40u);
  EXPECT_EQ(plan->n_tokens, 40u);

  // A share with no range after it takes the whole stream again (a plain cache: -np 1).
  auto single = DecoderShare::start(testing::small_share_header(256), true, memfd_only());
  ASSERT_TRUE(single.share(broker->socket_path(), 0, 2000));
  auto whole = broker->receive(2000);
  ASSERT_TRUE(whole) << whole.error().what();
  EXPECT_EQ(whole->first_cell, 0u);
  EXPECT_EQ(whole->n_cells, 0u);
}

// Issue #27, a unified cache: two slots' shares made one after the other, both before
// either adopt. Disjoint runs of stream 0 are both adoptable, in either order; only a later
// share whose cells overlap an earlier one's makes that one stale.
TEST_F(ShareAdopt, DisjointRunsOfOneStreamAreBothAdoptable) {
  auto decoder = DecoderShare::start(unified_three_slot_header(), true, memfd_only());
  ASSERT_TRUE(decoder.can_share()) << decoder.startup_warning();
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  auto share = [&](ShareCells cells) -> Result<uint64_t> {  // received at once: a small backlog
    auto id = decoder.share(broker->socket_path(), cells, 2000);
    if (id) {
      EXPECT_TRUE(broker->receive(2000));
    }
    return id;
  };
  auto slot1 = share(ShareCells{0, 0, 60});   // cells 0..59
  auto slot2 = share(ShareCells{0, 60, 57});  // cells 60..116
  auto slot3 = share(ShareCells{0, 200, 0});  // 200..511
  ASSERT_TRUE(slot1 && slot2 && slot3);
  EXPECT_LT(*slot1, *slot2);
  EXPECT_LT(*slot2, *slot3);
  EXPECT_EQ(decoder.latest_share_id(0), *slot3);
  EXPECT_EQ(decoder.n_pending_shares(), 3u);
  auto plan2 = decoder.adopt(57, *slot2, 0);
  ASSERT_TRUE(plan2) << plan2.error().what();
  EXPECT_EQ(plan2->first_cell, 60u);
  auto plan1 = decoder.adopt(60, *slot1, 0);
  ASSERT_TRUE(plan1) << "a share of cells 60..116 made the share of cells 0..59 stale: " << plan1.error().what();
  EXPECT_EQ(plan1->first_cell, 0u);
  EXPECT_EQ(plan1->n_tokens, 60u);
  auto plan3 = decoder.adopt(312, *slot3, 0);
  ASSERT_TRUE(plan3) << plan3.error().what();
  EXPECT_EQ(plan3->n_cells, 312u);
  EXPECT_EQ(decoder.n_pending_shares(), 0u);
  // Each id once.
  auto again = decoder.adopt(57, *slot2, 0);
  ASSERT_FALSE(again);
  EXPECT_EQ(again.error().errno_value(), ESTALE);
  EXPECT_NE(again.error().message().find("already adopted"), std::string::npos) << again.error().what();
}

TEST_F(ShareAdopt, AnOverlappingRunStalesTheEarlierShareOnly) {
  auto decoder = DecoderShare::start(unified_three_slot_header(), true, memfd_only());
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  // Each share received at once: the broker's listen backlog is small.
  auto share = [&](DecoderShare& from, ShareCells cells) -> Result<uint64_t> {
    auto id = from.share(broker->socket_path(), cells, 2000);
    if (id) {
      EXPECT_TRUE(broker->receive(2000));
    }
    return id;
  };
  auto a = share(decoder, ShareCells{0, 0, 60});    // 0..59
  auto b = share(decoder, ShareCells{0, 100, 20});  // 100..119
  auto c = share(decoder, ShareCells{0, 59, 10});   // 59..68: overlaps a at 59
  ASSERT_TRUE(a && b && c);
  auto stale = decoder.adopt(10, *a, 0);
  ASSERT_FALSE(stale);
  EXPECT_EQ(stale.error().errno_value(), ESTALE);
  EXPECT_EQ(http_status_for(stale.error()), 409);
  EXPECT_NE(
      stale.error().message().find(fmt::format(
          "share_id {}: it is stale, the later share {} of stream 0 (cells 59..68) overlaps its own (cells 0..59)", *a,
          *c)),
      std::string::npos)
      << stale.error().what();
  EXPECT_TRUE(decoder.adopt(20, *b, 0)) << "a run that overlaps only a made the disjoint b stale";
  // An adopted share is not made stale again, and the refusals above left c as it was.
  auto d = share(decoder, ShareCells{0, 110, 5});  // overlaps adopted b, not c
  ASSERT_TRUE(d);
  EXPECT_TRUE(decoder.adopt(10, *c, 0));
  // ERANGE past the share's n_cells still holds, and leaves the share adoptable.
  auto too_many = decoder.adopt(6, *d, 0);
  ASSERT_FALSE(too_many);
  EXPECT_EQ(too_many.error().errno_value(), ERANGE);
  // A share of the whole stream (no range) overlaps every run.
  auto e = share(decoder, ShareCells{0, 300, 10});
  ASSERT_TRUE(e);
  auto whole_decoder = DecoderShare::start(testing::small_share_header(512), true, memfd_only());
  auto r1 = share(whole_decoder, ShareCells{0, 10, 5});
  auto r2 = share(whole_decoder, ShareCells{0, 400, 5});
  auto all = share(whole_decoder, ShareCells{});
  ASSERT_TRUE(r1 && r2 && all);
  EXPECT_EQ(whole_decoder.adopt(5, *r1, 0).error().errno_value(), ESTALE);
  EXPECT_EQ(whole_decoder.adopt(5, *r2, 0).error().errno_value(), ESTALE);
  EXPECT_TRUE(whole_decoder.adopt(5, *all, 0));
  EXPECT_TRUE(decoder.adopt(5, *d, 0));
  EXPECT_TRUE(decoder.adopt(10, *e, 0));
}

// A share whose message reached no broker spends its id and still makes the earlier
// overlapping share stale, but is not adoptable itself (no provider wrote its cells).
TEST_F(ShareAdopt, AShareThatReachedNoBrokerIsNotAdoptable) {
  testing::TempDir dir;
  auto decoder = DecoderShare::start(unified_three_slot_header(), true, memfd_only());
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  auto share = [&](ShareCells cells) -> Result<uint64_t> {  // received at once: a small backlog
    auto id = decoder.share(broker->socket_path(), cells, 2000);
    if (id) {
      EXPECT_TRUE(broker->receive(2000));
    }
    return id;
  };
  auto sent = share(ShareCells{0, 0, 10});
  auto kept = share(ShareCells{0, 50, 10});
  ASSERT_TRUE(sent && kept);
  auto lost = decoder.share((dir / "nobody.sock").string(), ShareCells{0, 5, 10}, 200);
  ASSERT_FALSE(lost);
  const uint64_t lost_id = decoder.latest_share_id();
  EXPECT_EQ(lost_id, *kept + 1);
  auto never = decoder.adopt(5, lost_id, 0);
  ASSERT_FALSE(never);
  EXPECT_EQ(never.error().errno_value(), ESTALE);
  EXPECT_NE(never.error().message().find("never reached a broker"), std::string::npos) << never.error().what();
  EXPECT_EQ(decoder.adopt(5, *sent, 0).error().errno_value(), ESTALE);
  EXPECT_TRUE(decoder.adopt(5, *kept, 0));
  auto unknown = decoder.adopt(5, lost_id + 1, 0);
  ASSERT_FALSE(unknown);
  EXPECT_EQ(unknown.error().errno_value(), ESTALE);
}

TEST_F(ShareAdopt, RefusesARangePastKvSizeBeforeConnecting) {
  testing::TempDir dir;
  auto decoder = DecoderShare::start(unified_three_slot_header(), true, memfd_only());
  auto id = decoder.share((dir / "nobody.sock").string(), ShareCells{0, 500, 40}, 100);
  ASSERT_FALSE(id);
  EXPECT_EQ(id.error().errno_value(), EINVAL);
  EXPECT_NE(id.error().message().find("first_cell 500 n_cells 40: past the \"kv\" KV cache's kv_size 512"),
            std::string::npos)
      << id.error().what();
  auto past_end = decoder.share((dir / "nobody.sock").string(), ShareCells{0, 512, 0}, 100);
  ASSERT_FALSE(past_end);
  EXPECT_EQ(past_end.error().errno_value(), EINVAL);
  EXPECT_EQ(decoder.latest_share_id(), 0u);  // no id spent
}

TEST_F(ShareAdopt, RefusesARangeOfAnIswaMemorysUnifiedCaches) {
  testing::TempDir dir;
  auto shape = layout::derive_model_shape(layout::testing::mkmodel_gemma3().metadata());
  ASSERT_TRUE(shape) << shape.error().what();
  layout::KvParams params;
  params.n_ctx = 512;
  params.n_seq_max = 3;
  params.kv_unified = true;
  auto header = layout::make_share_header({"gemma3", "cells", 2, 256, 0, 0x1}, *shape, params);
  ASSERT_TRUE(header) << header.error().what();
  ASSERT_EQ(header->memory.kv_caches.size(), 2u);
  auto decoder = DecoderShare::start(*header, true, memfd_only());
  auto id = decoder.share((dir / "nobody.sock").string(), ShareCells{0, 4, 8}, 100);
  ASSERT_FALSE(id);
  EXPECT_EQ(id.error().errno_value(), ENOTSUP);
  EXPECT_NE(id.error().message().find("SWA cache's cells"), std::string::npos) << id.error().what();
}

TEST_F(ShareAdopt, TheBrokerRefusesARangePastKvSizeNamingTheField) {
  auto decoder = DecoderShare::start(unified_three_slot_header(), true, memfd_only());
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  ASSERT_TRUE(decoder.share(broker->socket_path(), ShareCells{0, 100, 40}, 2000));
  auto share = broker->receive(2000);
  ASSERT_TRUE(share) << share.error().what();
  handshake::Message message;
  message.share_id = 9;
  message.first_cell = 500;
  message.n_cells = 40;
  message.fds = share->entries;
  message.header = nlohmann::ordered_json::parse(layout::to_json(share->header, false));
  auto refused = check_share_message(std::move(message), std::move(share->fds), share->peer, "test decoder");
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().errno_value(), EINVAL);
  EXPECT_NE(refused.error().message().find(
                "field \"n_cells\" is 40 from first_cell 500, past the header's \"kv\" KV cache's kv_size 512"),
            std::string::npos)
      << refused.error().what();
}

TEST_F(ShareAdopt, RefusesARecurrentStateOfSeveralSequencesForTheFileRoute) {
  testing::TempDir dir;
  auto shape = layout::derive_model_shape(layout::testing::mkmodel_mamba2().metadata());
  ASSERT_TRUE(shape) << shape.error().what();
  layout::KvParams params;
  params.n_ctx = 256;
  params.n_seq_max = 2;
  params.kv_unified = false;
  auto header = layout::make_share_header({"mamba2", "streams", 2, 256, 0, 0x1}, *shape, params);
  ASSERT_TRUE(header) << header.error().what();
  ASSERT_TRUE(header->memory.recurrent);
  ASSERT_EQ(header->memory.recurrent->rs_size, 2u);
  auto decoder = DecoderShare::start(*header, true, memfd_only());
  auto id = decoder.share((dir / "nobody.sock").string(), 0, 100);
  ASSERT_FALSE(id);
  EXPECT_EQ(id.error().errno_value(), ENOTSUP);
  EXPECT_NE(id.error().message().find("recurrent state only with one sequence (-np 1)"), std::string::npos)
      << id.error().what();
  EXPECT_NE(id.error().message().find("rs_size 2"), std::string::npos);
}

TEST_F(ShareAdopt, TheBrokerReceivesTheStreamAndRefusesOnePastNStream) {
  auto decoder = DecoderShare::start(testing::three_stream_share_header(), true, memfd_only());
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  ASSERT_TRUE(decoder.share(broker->socket_path(), 2, 2000));
  auto share = broker->receive(2000);
  ASSERT_TRUE(share) << share.error().what();
  EXPECT_EQ(share->stream, 2u);

  // The same message with a stream the header has not, as a broken decoder would send it.
  handshake::Message message;
  message.share_id = 9;
  message.stream = 3;
  message.fds = share->entries;
  message.header = nlohmann::ordered_json::parse(layout::to_json(share->header, false));
  auto refused = check_share_message(std::move(message), std::move(share->fds), share->peer, "test decoder");
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().errno_value(), EINVAL);
  EXPECT_NE(refused.error().message().find("field \"stream\" is 3, the header's \"kv\" KV cache has n_stream 3"),
            std::string::npos)
      << refused.error().what();
}

TEST_F(ShareAdopt, ADecoderWithoutTheFlagRefusesNamingBothCausesAndTellsTheBroker) {
  auto decoder = DecoderShare::start(testing::small_share_header(), false, memfd_only());
  EXPECT_FALSE(decoder.can_share());
  EXPECT_TRUE(decoder.startup_warning().empty());  // nobody asked for sharing: nothing to warn about
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  auto id = decoder.share(broker->socket_path(), 0, 2000);
  ASSERT_FALSE(id);
  EXPECT_EQ(id.error().errno_value(), ENOTSUP);
  EXPECT_EQ(http_status_for(id.error()), 501);
  EXPECT_NE(id.error().message().find("either ONEBIT_KV_SHARE was not set when it started"), std::string::npos)
      << id.error().message();
  EXPECT_NE(id.error().message().find("or its KV backend cannot export its memory"), std::string::npos);
  // The broker hears the refusal at once instead of waiting for its timeout.
  auto share = broker->receive(2000);
  ASSERT_FALSE(share);
  EXPECT_EQ(share.error().errno_value(), ENOTSUP);
  EXPECT_NE(share.error().message().find("refused share"), std::string::npos) << share.error().message();
}

TEST_F(ShareAdopt, ADecoderWhoseBackendCannotExportWarnsOnceAndRefuses) {
  testing::TempDir dir;
  ExportOptions options;
  options.forced = RegionBackend::udmabuf;
  options.udmabuf_path = (dir / "udmabuf").string();
  auto decoder = DecoderShare::start(testing::small_share_header(), true, options);
  EXPECT_FALSE(decoder.can_share());
  EXPECT_NE(decoder.startup_warning().find("share_degrade: this decoder cannot export its KV memory"),
            std::string::npos)
      << decoder.startup_warning();
  auto id = decoder.share((dir / "nobody.sock").string(), 0, 100);
  ASSERT_FALSE(id);
  EXPECT_EQ(id.error().errno_value(), ENOTSUP);
  EXPECT_NE(id.error().message().find("ONEBIT_KV_SHARE is set, and the KV backend cannot export"), std::string::npos)
      << id.error().message();
}

TEST_F(ShareAdopt, BrokerTimesOutWhenTheDecoderNeverConnects) {
  auto broker = ShareBroker::listen();
  ASSERT_TRUE(broker);
  auto share = broker->receive(50);
  ASSERT_FALSE(share);
  EXPECT_EQ(share.error().errno_value(), ETIMEDOUT);
}

// One rule for the cells of a share, at both ends: what the decoder may share and what a
// provider may be told to write (the C API's kvshare_provider_set_cells and a resident
// provider's prefill call it too).
TEST(CheckCellsInMemory, ResolvesARangeToTheEndAndRefusesAStreamOrCellsPastTheCache) {
  const auto unified = unified_three_slot_header();
  auto to_end = check_cells_in_memory(unified, ShareCells{0, 500, 0});
  ASSERT_TRUE(to_end) << to_end.error().what();
  EXPECT_EQ(to_end->n_cells, 12u);  // cells 500..511
  auto whole = check_cells_in_memory(unified, ShareCells{0, 0, 0});
  ASSERT_TRUE(whole);
  EXPECT_FALSE(whole->names_range());
  auto past = check_cells_in_memory(unified, ShareCells{0, 500, 40});
  ASSERT_FALSE(past);
  EXPECT_EQ(past.error().errno_value(), EINVAL);
  EXPECT_NE(past.error().message().find("first_cell 500 n_cells 40: past the \"kv\" KV cache's kv_size 512"),
            std::string::npos)
      << past.error().what();
  auto stream = check_cells_in_memory(testing::three_stream_share_header(), ShareCells{3, 0, 0});
  ASSERT_FALSE(stream);
  EXPECT_EQ(stream.error().errno_value(), EINVAL);
  EXPECT_NE(stream.error().message().find("share of stream 3: the \"kv\" KV cache has n_stream 3"), std::string::npos)
      << stream.error().what();
}

TEST(CheckTokensFitCells, RefusesMoreTokensThanTheRangesCellsNamingBoth) {
  EXPECT_TRUE(check_tokens_fit_cells(ShareCells{0, 100, 40}, 40));
  EXPECT_TRUE(check_tokens_fit_cells(ShareCells{0, 0, 0}, 4096));  // no range: kv_size is the caller's
  auto over = check_tokens_fit_cells(ShareCells{1, 100, 40}, 41);
  ASSERT_FALSE(over);
  EXPECT_EQ(over.error().errno_value(), ERANGE);
  EXPECT_EQ(over.error().message(), "41 tokens do not fit the share's n_cells 40 (cells 100..139 of stream 1)");
}

TEST(CheckAdoptableMemoryKind, NamesTheKindAndTheKindsThatCanBeAdopted) {
  EXPECT_TRUE(check_adoptable_memory_kind(layout::MemoryKind::hybrid));
  auto refused = check_adoptable_memory_kind(layout::MemoryKind::hybrid_iswa);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().errno_value(), ENOTSUP);
  EXPECT_NE(refused.error().message().find("hybrid_iswa cannot be adopted yet (plain, iSWA, recurrent and hybrid"),
            std::string::npos)
      << refused.error().what();
}

}  // namespace
}  // namespace kvshare
