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

namespace kvshare::remote {
namespace {

using Clock = std::chrono::steady_clock;
using layout::testing::remote_example_header;

class RemoteTransfer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { ::setenv("UCX_TLS", "tcp", 0); }

  void SetUp() override {
    header_ = remote_example_header();
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

  // The provider's part: every granted range of cells [0, n) filled with `fill`.
  Result<void> send_cells(RemoteSender& sender, const RemoteOffer& offer, uint32_t n, std::byte fill) {
    payload_.assign(layout::granted_bytes(header_.layout, header_.memory, n), fill);
    size_t at = 0;
    for (const auto& layer : header_.memory.kv_caches[0].layers) {
      for (const layout::ChunkRange& r : layout::cell_ranges(header_.layout, header_.memory, layer.il, 0, n)) {
        if (auto ok = sender.write({offer.share_id, offer.secret, r.chunk, r.offset, r.size_bytes},
                                   std::span(payload_).subspan(at, r.size_bytes));
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
  std::vector<std::byte> payload_;
  std::unique_ptr<RemoteReceiver> receiver_;
  std::mutex log_mutex_;
  std::condition_variable logged_;
  std::vector<std::string> log_;
};

TEST_F(RemoteTransfer, LandsTheGrantedCellsAndAdoptsAfterAMatchingCompletion) {
  auto offer = receiver_->grant(10);
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
  auto offer = receiver_->grant(10);
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
  EXPECT_NE(receiver_->counters().last_refusal.find("outside cells 0..9 of cache_k_l0"), std::string::npos)
      << receiver_->counters().last_refusal;
  // The share is spoiled: its adopt fails even though nothing of it landed.
  auto adopted = receiver_->complete(offer->share_id, 10);
  ASSERT_FALSE(adopted);
  EXPECT_EQ(adopted.error().errno_value(), EIO);
}

TEST_F(RemoteTransfer, RefusesAWriteIntoAnotherChunkOrPastTheRegion) {
  auto offer = receiver_->grant(4);
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
  auto offer = receiver_->grant(4);
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
  auto first = receiver_->grant(2);
  auto second = receiver_->grant(2);
  ASSERT_TRUE(first && second);
  EXPECT_NE(first->secret, layout::RemoteSecret{});
  EXPECT_NE(first->secret, second->secret);
}

TEST_F(RemoteTransfer, RefusesAWriteWithTheWrongSecretWithoutSpoilingTheShare) {
  auto offer = receiver_->grant(10);
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
  auto offer = receiver_->grant(3);
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
  auto offer = receiver_->grant(4);
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
  auto offer = receiver_->grant(10);
  ASSERT_TRUE(offer);
  auto sender = connect(*offer);
  // Layer 0 only, and no completion: the provider "died" halfway.
  std::vector<std::byte> rows(10 * 256, std::byte{0x22});
  for (const auto& r : layout::cell_ranges(header_.layout, header_.memory, 0, 0, 10))
    ASSERT_TRUE(sender->write({offer->share_id, offer->secret, r.chunk, r.offset, r.size_bytes}, rows));
  ASSERT_TRUE(sender->flush(Clock::now() + std::chrono::seconds(10)));
  auto adopted = receiver_->complete(offer->share_id, 10);
  ASSERT_FALSE(adopted);
  EXPECT_EQ(adopted.error().errno_value(), EIO);
  EXPECT_NE(adopted.error().message().find("partial transfer"), std::string::npos) << adopted.error().message();
}

TEST_F(RemoteTransfer, RefusesACompletionWhoseByteCountOrLayoutHashDiffers) {
  auto offer = receiver_->grant(3);
  ASSERT_TRUE(offer);
  auto sender = connect(*offer);
  ASSERT_TRUE(send_cells(*sender, *offer, 3, std::byte{1}));
  ASSERT_TRUE(finish(*sender, *offer, 3, sender->bytes_sent() + 1, offer->layout_hash));
  auto adopted = receiver_->complete(offer->share_id, 3);
  ASSERT_FALSE(adopted);
  EXPECT_NE(adopted.error().message().find("byte count mismatch"), std::string::npos) << adopted.error().message();

  auto second = receiver_->grant(3);
  auto sender2 = connect(*second);
  ASSERT_TRUE(send_cells(*sender2, *second, 3, std::byte{2}));
  ASSERT_TRUE(finish(*sender2, *second, 3, sender2->bytes_sent(), second->layout_hash ^ 1));
  adopted = receiver_->complete(second->share_id, 3);
  ASSERT_FALSE(adopted);
  EXPECT_NE(adopted.error().message().find("layout hash"), std::string::npos) << adopted.error().message();
}

TEST_F(RemoteTransfer, RefusesWritesAndTheAdoptAfterTheDeadline) {
  auto offer = receiver_->grant(2, std::chrono::milliseconds(100));
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
  auto offer = receiver_->grant(2);
  ASSERT_TRUE(offer);
  receiver_->revoke("the test reuses the cells");
  auto sender = connect(*offer);
  std::vector<std::byte> rows(256, std::byte{0x44});
  EXPECT_FALSE(sender->write({offer->share_id, offer->secret, k0().chunk, k0().offset, 256}, rows).and_then([&] {
    return sender->flush(Clock::now() + std::chrono::seconds(10));
  }));
  EXPECT_EQ(at(k0(), 0), std::byte{0});
  EXPECT_NE(receiver_->counters().last_refusal.find("revoked"), std::string::npos);
}

TEST_F(RemoteTransfer, MakesTheEarlierShareStaleWhenANewOneIsGranted) {
  auto first = receiver_->grant(2);
  auto second = receiver_->grant(2);
  ASSERT_TRUE(first && second);
  EXPECT_NE(first->share_id, second->share_id);
  auto adopted = receiver_->complete(first->share_id, 2);
  ASSERT_FALSE(adopted);
  EXPECT_EQ(adopted.error().errno_value(), ESTALE);
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
