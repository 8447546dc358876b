// The remote route's transport in one process: a RemoteReceiver over arrays standing in
// for the decoder's chunks, and a RemoteSender playing the provider (or an attacker)
// over UCX on tcp loopback. Every refusal leaves the decoder's bytes as they were.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "kvshare/remote/remote_receiver.h"
#include "kvshare/remote/remote_sender.h"
#include "kvshare/remote/ucx_common.h"
#include "layout/remote_grant.h"
#include "remote_fixture.h"

#include <fmt/format.h>

namespace kvshare::remote {
namespace {

using Clock = std::chrono::steady_clock;
using layout::testing::remote_example_header;

class RemoteTransfer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { ::setenv("UCX_TLS", "tcp", 0); }

  void SetUp() override {
    // -np 4 without --kv-unified: 4 streams of 512 cells, one per slot.
    header_ = remote_example_header(2048, true, 4);
    for (const auto& chunk : header_.layout.chunks) decoder_chunks_.emplace_back(chunk.size_bytes, std::byte{0});
    std::vector<std::span<std::byte>> spans(decoder_chunks_.begin(), decoder_chunks_.end());
    auto receiver = RemoteReceiver::start(header_, spans, [this](const std::string& line) {
      std::lock_guard lock(log_mutex_);
      log_.push_back(line);
      logged_.notify_all();
    });
    if (!receiver && receiver.error().errno_value() == ENOTSUP) GTEST_SKIP() << receiver.error().what();
    ASSERT_TRUE(receiver) << receiver.error().what();
    receiver_ = std::move(*receiver);
  }

  std::unique_ptr<RemoteSender> connect(const RemoteOffer& offer) {
    auto sender = RemoteSender::connect(offer.worker_address);
    EXPECT_TRUE(sender) << sender.error().what();
    return sender ? std::move(*sender) : nullptr;
  }

  // The provider's part: every granted cell of positions [n_cached, n) filled with `fill`.
  // Its own payload, so two providers can send at once.
  static Result<void> send_cells(RemoteSender& sender, const RemoteOffer& offer, uint32_t n, std::byte fill) {
    auto grant = offer_grant(offer);
    if (!grant) return fail(grant.error());
    grant->cell_end = offer.first_cell + n;
    std::vector<std::byte> payload(layout::granted_bytes(*grant), fill);
    size_t at = 0;
    for (const auto& layer : offer.header.memory.kv_caches[0].layers) {
      for (const layout::ChunkRange& r : layout::cell_ranges(offer.header.layout, offer.header.memory, layer.il,
                                                             grant->stream, grant->cell_begin, grant->cell_end)) {
        if (auto ok = sender.write({offer.share_id, offer.secret, r.chunk, r.offset, r.size_bytes},
                                   std::span(payload).subspan(at, r.size_bytes));
            !ok)
          return ok;
        at += r.size_bytes;
      }
    }
    return sender.flush(Clock::now() + std::chrono::seconds(10));
  }

  Result<void> finish(RemoteSender& sender, const RemoteOffer& offer, uint32_t n, uint64_t bytes, uint64_t hash) {
    return sender.finish({offer.share_id, offer.secret, n, bytes, hash}, Clock::now() + std::chrono::seconds(10));
  }

  std::byte at(const layout::SharedTensor& t, uint64_t offset) const {
    return decoder_chunks_[t.chunk][t.offset + offset];
  }
  // Byte 0 of cell `cell` of `stream` of layer 0's K.
  std::byte k0_cell(uint32_t stream, uint32_t cell) const {
    return at(k0(), (static_cast<uint64_t>(stream) * header_.memory.kv_caches[0].kv_size + cell) * 256);
  }
  const layout::SharedTensor& k0() const { return *header_.layout.find(0, 0, layout::TensorKind::k); }
  std::string log_text() {
    std::lock_guard lock(log_mutex_);
    std::string all;
    for (const auto& l : log_) all += l + "\n";
    return all;
  }
  // Waits until the receiver has said a line containing `words` (the bound only keeps a
  // broken build from hanging: the condition ends the wait).
  bool wait_logged(const std::string& words) {
    std::unique_lock lock(log_mutex_);
    return logged_.wait_for(lock, std::chrono::seconds(30), [&] {
      for (const auto& l : log_)
        if (l.find(words) != std::string::npos) return true;
      return false;
    });
  }
  static layout::RemoteSecret wrong_secret(const RemoteOffer& offer) {
    layout::RemoteSecret s = offer.secret;
    s[15] ^= std::byte{1};  // right but for the last bit: the compare must look at every byte
    return s;
  }

  layout::ShareHeader header_;
  std::vector<std::vector<std::byte>> decoder_chunks_;
  std::unique_ptr<RemoteReceiver> receiver_;
  std::mutex log_mutex_;
  std::condition_variable logged_;
  std::vector<std::string> log_;
};

TEST_F(RemoteTransfer, LandsTheGrantedCellsAndAdoptsAfterAMatchingCompletion) {
  auto offer = receiver_->grant({.n_cells = 10});
  ASSERT_TRUE(offer) << offer.error().what();
  auto sender = connect(*offer);
  ASSERT_TRUE(sender);
  ASSERT_TRUE(send_cells(*sender, *offer, 10, std::byte{0x5a}));
  EXPECT_EQ(sender->bytes_sent(), offer->bytes);
  ASSERT_TRUE(finish(*sender, *offer, 10, sender->bytes_sent(), offer->layout_hash));
  auto adopted = receiver_->complete(offer->share_id, 10);
  ASSERT_TRUE(adopted) << adopted.error().what();
  EXPECT_EQ(at(k0(), 0), std::byte{0x5a});
  EXPECT_EQ(at(k0(), 10 * 256 - 1), std::byte{0x5a});
  EXPECT_EQ(at(k0(), 10 * 256), std::byte{0}) << "cell 10 was not granted";
}

TEST_F(RemoteTransfer, RefusesAWriteOutsideTheShareAndLeavesThoseBytesAlone) {
  auto offer = receiver_->grant({.n_cells = 10});
  ASSERT_TRUE(offer);
  auto sender = connect(*offer);
  ASSERT_TRUE(sender);
  // The attack: cell 10 of layer 0's K, one row past the grant.
  std::vector<std::byte> evil(256, std::byte{0xee});
  auto posted = sender->write({offer->share_id, offer->secret, k0().chunk, k0().offset + 10 * 256, 256}, evil);
  auto flushed = posted ? sender->flush(Clock::now() + std::chrono::seconds(10)) : posted;
  ASSERT_FALSE(flushed);
  EXPECT_EQ(flushed.error().errno_value(), ECONNREFUSED) << flushed.error().what();
  EXPECT_EQ(at(k0(), 10 * 256), std::byte{0});
  EXPECT_EQ(receiver_->counters().writes_refused, 1u);
  EXPECT_NE(receiver_->counters().last_refusal.find("outside cells 0..9 of stream 0 of cache_k_l0"), std::string::npos)
      << receiver_->counters().last_refusal;
  // The share is spoiled: its adopt fails even though nothing of it landed.
  auto adopted = receiver_->complete(offer->share_id, 10);
  ASSERT_FALSE(adopted);
  EXPECT_EQ(adopted.error().errno_value(), EIO);
}

TEST_F(RemoteTransfer, RefusesAWriteIntoAnotherChunkOrPastTheRegion) {
  auto offer = receiver_->grant({.n_cells = 4});
  ASSERT_TRUE(offer);
  auto sender = connect(*offer);
  ASSERT_TRUE(sender);
  std::vector<std::byte> evil(64, std::byte{0xee});
  ASSERT_FALSE(sender->write({offer->share_id, offer->secret, 99, 0, 64}, evil).and_then([&] {
    return sender->flush(Clock::now() + std::chrono::seconds(10));
  }));
  auto again = connect(*offer);
  const uint64_t past_the_region = header_.layout.chunks[0].size_bytes - 32;
  ASSERT_FALSE(again->write({offer->share_id, offer->secret, 0, past_the_region, 64}, evil).and_then([&] {
    return again->flush(Clock::now() + std::chrono::seconds(10));
  }));
  EXPECT_EQ(receiver_->counters().writes_refused, 2u);
  for (const auto& chunk : decoder_chunks_)
    for (std::byte b : chunk) ASSERT_EQ(b, std::byte{0});
}

TEST_F(RemoteTransfer, RefusesAWriteThatCarriesAnotherShareId) {
  auto offer = receiver_->grant({.n_cells = 4});
  ASSERT_TRUE(offer);
  auto sender = connect(*offer);
  std::vector<std::byte> rows(256, std::byte{0x11});
  auto flushed = sender->write({offer->share_id + 1, offer->secret, k0().chunk, k0().offset, 256}, rows).and_then([&] {
    return sender->flush(Clock::now() + std::chrono::seconds(10));
  });
  ASSERT_FALSE(flushed);
  EXPECT_EQ(at(k0(), 0), std::byte{0});
  EXPECT_NE(receiver_->counters().last_refusal.find("is not the open share"), std::string::npos);
}

TEST_F(RemoteTransfer, GrantsEachShareItsOwnSecret) {
  auto first = receiver_->grant({.n_cells = 2});
  auto second = receiver_->grant({.n_cells = 2});
  ASSERT_TRUE(first && second);
  EXPECT_NE(first->secret, layout::RemoteSecret{});
  EXPECT_NE(first->secret, second->secret);
}

TEST_F(RemoteTransfer, RefusesAWriteWithTheWrongSecretWithoutSpoilingTheShare) {
  auto offer = receiver_->grant({.n_cells = 10});
  ASSERT_TRUE(offer);
  auto forger = connect(*offer);
  ASSERT_TRUE(forger);
  // The forger knows the share_id and the granted cells, not the secret.
  std::vector<std::byte> evil(256, std::byte{0xee});
  auto flushed =
      forger->write({offer->share_id, wrong_secret(*offer), k0().chunk, k0().offset, 256}, evil).and_then([&] {
        return forger->flush(Clock::now() + std::chrono::seconds(10));
      });
  ASSERT_FALSE(flushed);
  EXPECT_EQ(flushed.error().errno_value(), ECONNREFUSED) << flushed.error().what();
  EXPECT_EQ(at(k0(), 0), std::byte{0}) << "the refused write's payload was received";
  const ReceiverCounters refused = receiver_->counters();
  EXPECT_EQ(refused.writes_refused, 1u);
  EXPECT_EQ(refused.bytes_accepted, 0u);
  EXPECT_NE(refused.last_refusal.find("the secret is not the open share's"), std::string::npos) << refused.last_refusal;
  EXPECT_NE(log_text().find("the secret is not the open share's"), std::string::npos) << log_text();
  EXPECT_EQ(log_text().find(to_hex({offer->secret.begin(), offer->secret.end()})), std::string::npos)
      << "the log shows the secret";
  // The real provider's transfer still lands and adopts.
  auto provider = connect(*offer);
  ASSERT_TRUE(provider);
  ASSERT_TRUE(send_cells(*provider, *offer, 10, std::byte{0x5a}));
  ASSERT_TRUE(finish(*provider, *offer, 10, provider->bytes_sent(), offer->layout_hash));
  auto adopted = receiver_->complete(offer->share_id, 10);
  ASSERT_TRUE(adopted) << adopted.error().what();
  EXPECT_EQ(at(k0(), 0), std::byte{0x5a});
}

TEST_F(RemoteTransfer, RefusesACompletionWithTheWrongSecret) {
  auto offer = receiver_->grant({.n_cells = 3});
  ASSERT_TRUE(offer);
  auto sender = connect(*offer);
  ASSERT_TRUE(send_cells(*sender, *offer, 3, std::byte{1}));
  ASSERT_TRUE(sender->finish({offer->share_id, wrong_secret(*offer), 3, sender->bytes_sent(), offer->layout_hash},
                             Clock::now() + std::chrono::seconds(10)));
  ASSERT_TRUE(wait_logged("remote completion refused"));
  EXPECT_NE(receiver_->counters().last_refusal.find("the secret is not the open share's"), std::string::npos)
      << receiver_->counters().last_refusal;
  EXPECT_EQ(receiver_->counters().writes_refused, 1u);
  // It did not count as the provider's completion.
  auto adopted = receiver_->complete(offer->share_id, 3);
  ASSERT_FALSE(adopted);
  EXPECT_NE(adopted.error().message().find("no completion message"), std::string::npos) << adopted.error().message();
}

TEST_F(RemoteTransfer, RefusesGarbageHeadersByName) {
  auto offer = receiver_->grant({.n_cells = 4});
  ASSERT_TRUE(offer);
  auto sender = connect(*offer);
  std::vector<std::byte> garbage(7, std::byte{0x42});
  std::vector<std::byte> rows(256, std::byte{0x11});
  auto flushed = sender->send_raw(kAmWrite, garbage, rows).and_then([&] {
    return sender->flush(Clock::now() + std::chrono::seconds(10));
  });
  ASSERT_FALSE(flushed);
  EXPECT_NE(receiver_->counters().last_refusal.find("7 bytes, expected 56"), std::string::npos)
      << receiver_->counters().last_refusal;
  EXPECT_EQ(at(k0(), 0), std::byte{0});
}

TEST_F(RemoteTransfer, RefusesTheAdoptOfAPartialTransfer) {
  auto offer = receiver_->grant({.n_cells = 10});
  ASSERT_TRUE(offer);
  auto sender = connect(*offer);
  // Layer 0 only, and no completion: the provider "died" halfway.
  std::vector<std::byte> rows(10 * 256, std::byte{0x22});
  for (const auto& r : layout::cell_ranges(header_.layout, header_.memory, 0, 0, 0, 10))
    ASSERT_TRUE(sender->write({offer->share_id, offer->secret, r.chunk, r.offset, r.size_bytes}, rows));
  ASSERT_TRUE(sender->flush(Clock::now() + std::chrono::seconds(10)));
  auto adopted = receiver_->complete(offer->share_id, 10);
  ASSERT_FALSE(adopted);
  EXPECT_EQ(adopted.error().errno_value(), EIO);
  EXPECT_NE(adopted.error().message().find("partial transfer"), std::string::npos) << adopted.error().message();
}

TEST_F(RemoteTransfer, RefusesACompletionWhoseByteCountOrLayoutHashDiffers) {
  auto offer = receiver_->grant({.n_cells = 3});
  ASSERT_TRUE(offer);
  auto sender = connect(*offer);
  ASSERT_TRUE(send_cells(*sender, *offer, 3, std::byte{1}));
  ASSERT_TRUE(finish(*sender, *offer, 3, sender->bytes_sent() + 1, offer->layout_hash));
  auto adopted = receiver_->complete(offer->share_id, 3);
  ASSERT_FALSE(adopted);
  EXPECT_NE(adopted.error().message().find("byte count mismatch"), std::string::npos) << adopted.error().message();

  auto second = receiver_->grant({.n_cells = 3});
  auto sender2 = connect(*second);
  ASSERT_TRUE(send_cells(*sender2, *second, 3, std::byte{2}));
  ASSERT_TRUE(finish(*sender2, *second, 3, sender2->bytes_sent(), second->layout_hash ^ 1));
  adopted = receiver_->complete(second->share_id, 3);
  ASSERT_FALSE(adopted);
  EXPECT_NE(adopted.error().message().find("layout hash"), std::string::npos) << adopted.error().message();
}

TEST_F(RemoteTransfer, RefusesWritesAndTheAdoptAfterTheDeadline) {
  auto offer = receiver_->grant({.n_cells = 2}, std::chrono::milliseconds(100));
  ASSERT_TRUE(offer);
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  auto sender = connect(*offer);
  std::vector<std::byte> rows(256, std::byte{0x33});
  EXPECT_FALSE(sender->write({offer->share_id, offer->secret, k0().chunk, k0().offset, 256}, rows).and_then([&] {
    return sender->flush(Clock::now() + std::chrono::seconds(10));
  }));
  EXPECT_EQ(at(k0(), 0), std::byte{0});
  auto adopted = receiver_->complete(offer->share_id, 2);
  ASSERT_FALSE(adopted);
  EXPECT_NE(adopted.error().message().find("deadline"), std::string::npos) << adopted.error().message();
  EXPECT_NE(log_text().find("passed its deadline"), std::string::npos);
}

TEST_F(RemoteTransfer, StopsAcceptingWritesOnceRevoked) {
  auto offer = receiver_->grant({.n_cells = 2});
  ASSERT_TRUE(offer);
  receiver_->revoke(offer->share_id, "the test reuses the cells");
  auto sender = connect(*offer);
  std::vector<std::byte> rows(256, std::byte{0x44});
  EXPECT_FALSE(sender->write({offer->share_id, offer->secret, k0().chunk, k0().offset, 256}, rows).and_then([&] {
    return sender->flush(Clock::now() + std::chrono::seconds(10));
  }));
  EXPECT_EQ(at(k0(), 0), std::byte{0});
  EXPECT_NE(receiver_->counters().last_refusal.find("revoked"), std::string::npos);
}

TEST_F(RemoteTransfer, MakesTheEarlierShareStaleWhenANewOneIsGranted) {
  auto first = receiver_->grant({.n_cells = 2});
  auto second = receiver_->grant({.n_cells = 2});
  ASSERT_TRUE(first && second);
  EXPECT_NE(first->share_id, second->share_id);
  auto adopted = receiver_->complete(first->share_id, 2);
  ASSERT_FALSE(adopted);
  EXPECT_EQ(adopted.error().errno_value(), ESTALE);
}

// Two slots' grants: slot 1 the whole prompt from cell 0 of stream 1, slot 2 a prompt
// placed from cell 100 of stream 2 whose first 10 positions the decoder holds.
constexpr PromptCells kSlot1{.stream = 1, .first_cell = 0, .n_cached = 0, .n_cells = 20};
constexpr PromptCells kSlot2{.stream = 2, .first_cell = 100, .n_cached = 10, .n_cells = 30};

TEST_F(RemoteTransfer, LandsTwoGrantsInTwoStreamsWrittenConcurrentlyAndAdoptsBoth) {
  auto a = receiver_->grant(kSlot1);
  auto b = receiver_->grant(kSlot2);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(receiver_->open_grants(), 2u);
  EXPECT_NE(a->secret, b->secret);
  EXPECT_EQ(b->stream, 2u);
  EXPECT_EQ(b->first_cell, 100u);
  EXPECT_EQ(b->n_cached, 10u);
  EXPECT_EQ(b->bytes, 2u * 2 * 20 * 256);
  // Both providers connect first, then write at once: each waits for the other's start.
  auto provider_a = connect(*a);
  auto provider_b = connect(*b);
  ASSERT_TRUE(provider_a && provider_b);
  std::mutex m;
  std::condition_variable cv;
  int ready = 0;
  auto run = [&](RemoteSender& sender, const RemoteOffer& offer, uint32_t n, std::byte fill) -> Result<void> {
    {
      std::unique_lock lock(m);
      ++ready;
      cv.notify_all();
      cv.wait(lock, [&] { return ready == 2; });
    }
    if (auto sent = send_cells(sender, offer, n, fill); !sent) return sent;
    return finish(sender, offer, n, sender.bytes_sent(), offer.layout_hash);
  };
  Result<void> done_a, done_b;
  std::thread ta([&] { done_a = run(*provider_a, *a, 20, std::byte{0xa1}); });
  std::thread tb([&] { done_b = run(*provider_b, *b, 30, std::byte{0xb2}); });
  ta.join();
  tb.join();
  ASSERT_TRUE(done_a) << done_a.error().what();
  ASSERT_TRUE(done_b) << done_b.error().what();
  auto adopted_b = receiver_->complete(b->share_id, 30);
  ASSERT_TRUE(adopted_b) << adopted_b.error().what();
  EXPECT_EQ(*adopted_b, b->bytes);
  auto adopted_a = receiver_->complete(a->share_id, 20);
  ASSERT_TRUE(adopted_a) << adopted_a.error().what();
  EXPECT_EQ(k0_cell(1, 0), std::byte{0xa1});
  EXPECT_EQ(k0_cell(1, 19), std::byte{0xa1});
  EXPECT_EQ(k0_cell(1, 20), std::byte{0});
  EXPECT_EQ(k0_cell(2, 109), std::byte{0}) << "a cached position was written";
  EXPECT_EQ(k0_cell(2, 110), std::byte{0xb2});
  EXPECT_EQ(k0_cell(2, 129), std::byte{0xb2});
  EXPECT_EQ(k0_cell(2, 130), std::byte{0});
  EXPECT_EQ(k0_cell(0, 0), std::byte{0});
  EXPECT_EQ(receiver_->open_grants(), 0u);
}

TEST_F(RemoteTransfer, RefusesAWriteWithGrantASecretIntoGrantBWithoutSpoilingB) {
  auto a = receiver_->grant(kSlot1);
  auto b = receiver_->grant(kSlot2);
  ASSERT_TRUE(a && b);
  auto forger = connect(*a);
  ASSERT_TRUE(forger);
  std::vector<std::byte> evil(256, std::byte{0xee});
  const uint64_t b_cell = (2u * 512 + 110) * 256;
  // B's share_id with A's secret: refused by B's secret, spoiling nothing.
  auto named_b = forger->write({b->share_id, a->secret, k0().chunk, k0().offset + b_cell, 256}, evil).and_then([&] {
    return forger->flush(Clock::now() + std::chrono::seconds(10));
  });
  ASSERT_FALSE(named_b);
  EXPECT_NE(receiver_->counters().last_refusal.find("the secret is not the open share's"), std::string::npos)
      << receiver_->counters().last_refusal;
  // A's own share_id and secret, into B's cells: outside A's grant (another stream).
  auto again = connect(*a);
  auto named_a = again->write({a->share_id, a->secret, k0().chunk, k0().offset + b_cell, 256}, evil).and_then([&] {
    return again->flush(Clock::now() + std::chrono::seconds(10));
  });
  ASSERT_FALSE(named_a);
  EXPECT_EQ(named_a.error().errno_value(), ECONNREFUSED) << named_a.error().what();
  EXPECT_NE(receiver_->counters().last_refusal.find("into stream 2 of cache_k_l0, the grant is stream 1"),
            std::string::npos)
      << receiver_->counters().last_refusal;
  EXPECT_EQ(k0_cell(2, 110), std::byte{0});
  // A is spoiled (its own secret carried a bad write); B lands and adopts.
  auto provider_b = connect(*b);
  ASSERT_TRUE(send_cells(*provider_b, *b, 30, std::byte{0xb2}));
  ASSERT_TRUE(finish(*provider_b, *b, 30, provider_b->bytes_sent(), b->layout_hash));
  auto adopted_b = receiver_->complete(b->share_id, 30);
  ASSERT_TRUE(adopted_b) << adopted_b.error().what();
  auto adopted_a = receiver_->complete(a->share_id, 20);
  ASSERT_FALSE(adopted_a);
  EXPECT_EQ(adopted_a.error().errno_value(), EIO);
  EXPECT_NE(adopted_a.error().message().find("into stream 2"), std::string::npos) << adopted_a.error().message();
}

TEST_F(RemoteTransfer, RevokingOneGrantLeavesTheOtherWritable) {
  auto a = receiver_->grant(kSlot1);
  auto b = receiver_->grant(kSlot2);
  ASSERT_TRUE(a && b);
  receiver_->revoke(a->share_id, "slot 1's handoff failed");
  EXPECT_EQ(receiver_->open_grants(), 1u);
  auto provider_a = connect(*a);
  EXPECT_FALSE(send_cells(*provider_a, *a, 20, std::byte{0xa1}));
  EXPECT_EQ(k0_cell(1, 0), std::byte{0});
  auto provider_b = connect(*b);
  ASSERT_TRUE(send_cells(*provider_b, *b, 30, std::byte{0xb2}));
  ASSERT_TRUE(finish(*provider_b, *b, 30, provider_b->bytes_sent(), b->layout_hash));
  auto adopted_b = receiver_->complete(b->share_id, 30);
  ASSERT_TRUE(adopted_b) << adopted_b.error().what();
  EXPECT_EQ(k0_cell(2, 110), std::byte{0xb2});
  auto adopted_a = receiver_->complete(a->share_id, 20);
  ASSERT_FALSE(adopted_a);
  EXPECT_EQ(adopted_a.error().errno_value(), ESTALE);
}

TEST_F(RemoteTransfer, ANewGrantOverlappingAnOpenOneRevokesThatOneOnly) {
  auto a = receiver_->grant(kSlot1);
  auto b = receiver_->grant(kSlot2);
  ASSERT_TRUE(a && b);
  // Slot 1's next prompt: cells 10..14 of stream 1 are A's.
  auto c = receiver_->grant({.stream = 1, .first_cell = 10, .n_cached = 0, .n_cells = 5});
  ASSERT_TRUE(c) << c.error().what();
  EXPECT_EQ(receiver_->open_grants(), 2u);
  EXPECT_NE(log_text().find(
                fmt::format("share {} revoked (a new share of cells 10..14 of stream 1 replaces it)", a->share_id)),
            std::string::npos)
      << log_text();
  EXPECT_EQ(log_text().find(fmt::format("share {} revoked", b->share_id)), std::string::npos) << log_text();
  auto adopted_a = receiver_->complete(a->share_id, 20);
  ASSERT_FALSE(adopted_a);
  EXPECT_EQ(adopted_a.error().errno_value(), ESTALE);
  // The cached part of a prompt counts too: the decoder reads those cells.
  auto d = receiver_->grant({.stream = 2, .first_cell = 120, .n_cached = 20, .n_cells = 25});
  ASSERT_TRUE(d);
  EXPECT_FALSE(receiver_->issued(0));
  auto adopted_b = receiver_->complete(b->share_id, 30);
  ASSERT_FALSE(adopted_b);
  EXPECT_EQ(adopted_b.error().errno_value(), ESTALE);
  // Cells next to an open grant do not overlap it.
  auto e = receiver_->grant({.stream = 1, .first_cell = 15, .n_cached = 0, .n_cells = 5});
  ASSERT_TRUE(e);
  EXPECT_EQ(receiver_->open_grants(), 3u);
  receiver_->revoke_all("the decoder evaluates");
  EXPECT_EQ(receiver_->open_grants(), 0u);
}

TEST_F(RemoteTransfer, RefusesAnAdoptOfCachedPositionsOnlyOrPastTheGrant) {
  auto b = receiver_->grant(kSlot2);
  ASSERT_TRUE(b);
  auto provider = connect(*b);
  ASSERT_TRUE(send_cells(*provider, *b, 30, std::byte{1}));
  ASSERT_TRUE(finish(*provider, *b, 30, provider->bytes_sent(), b->layout_hash));
  auto adopted = receiver_->complete(b->share_id, 31);
  ASSERT_FALSE(adopted);
  EXPECT_EQ(adopted.error().errno_value(), ERANGE);
  EXPECT_NE(adopted.error().message().find("adopt of 31 tokens, the share granted positions 10..29"), std::string::npos)
      << adopted.error().message();
}

TEST(RemoteSenderConnect, RefusesAWorkerAddressOfZerosWithoutCrashing) {
  ::setenv("UCX_TLS", "tcp", 0);
  const std::vector<std::byte> garbage(60, std::byte{0});
  auto sender = RemoteSender::connect(garbage);
  if (!sender && sender.error().errno_value() == ENOTSUP) GTEST_SKIP() << sender.error().what();
  ASSERT_FALSE(sender);
  EXPECT_NE(sender.error().message().find("connecting to the decoder's worker (60-byte address)"), std::string::npos)
      << sender.error().what();
}

}  // namespace
}  // namespace kvshare::remote
