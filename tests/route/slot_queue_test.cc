#include "route/slot_queue.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace kvshare::route {
namespace {

TEST(SlotQueue, GrantsTheSlotInArrivalOrder) {
  SlotQueue queue;
  SlotQueue::Hold first = queue.acquire();
  std::vector<int> order;
  std::mutex order_mutex;
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      SlotQueue::Hold hold = queue.acquire();
      std::lock_guard lock(order_mutex);
      order.push_back(i);
    });
    // Each waiter has its ticket before the next one starts.
    while (queue.waiting() != static_cast<uint64_t>(i + 2)) std::this_thread::yield();
  }
  first.release();
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
}

TEST(SlotQueue, ReleaseIsIdempotentAndMovesWithTheHold) {
  SlotQueue queue;
  SlotQueue::Hold hold = queue.acquire();
  SlotQueue::Hold moved = std::move(hold);
  EXPECT_FALSE(hold.held());
  moved.release();
  moved.release();
  EXPECT_EQ(queue.waiting(), 0u);
  SlotQueue::Hold again = queue.acquire();  // would block forever had a release been lost
  EXPECT_TRUE(again.held());
}

TEST(SlotQueue, WaitIdleWaitsForEveryDecodeInFlight) {
  SlotQueue queue;
  EXPECT_TRUE(queue.wait_idle(std::chrono::milliseconds(0)));
  auto decode = std::make_unique<SlotQueue::Decode>(queue.begin_decode());
  EXPECT_FALSE(queue.wait_idle(std::chrono::milliseconds(10)));
  std::thread finisher([&] { decode.reset(); });
  EXPECT_TRUE(queue.wait_idle(std::chrono::seconds(10)));
  finisher.join();
}

TEST(SlotQueue, HoldsAsManyRequestsAsSlotsEachInItsOwnSlot) {
  SlotQueue queue(4);
  std::vector<SlotQueue::Hold> holds;
  for (int i = 0; i < 4; ++i) holds.push_back(queue.acquire());  // none of these may block
  std::vector<int> slots;
  for (const auto& hold : holds) slots.push_back(hold.slot());
  EXPECT_EQ(slots, (std::vector<int>{0, 1, 2, 3}));
  std::atomic<int> fifth_slot{-1};
  std::thread fifth([&] { fifth_slot = queue.acquire().slot(); });
  while (queue.waiting() != 5u) std::this_thread::yield();
  EXPECT_EQ(fifth_slot.load(), -1);  // every slot is held: the fifth waits
  holds[2].release();
  fifth.join();
  EXPECT_EQ(fifth_slot.load(), 2);
}

TEST(SlotQueue, GivesEachRequestTheFreeSlotItPrefers) {
  SlotQueue queue(4);
  SlotQueue::Hold busy = queue.acquire([](int slot) { return slot == 3 ? 10u : 0u; });
  EXPECT_EQ(busy.slot(), 3);
  // Slot 3 scores highest again but is held: the best free one wins.
  SlotQueue::Hold next = queue.acquire([](int slot) { return slot == 3 ? 10u : slot == 1 ? 5u : 0u; });
  EXPECT_EQ(next.slot(), 1);
  EXPECT_EQ(queue.acquire().slot(), 0);  // no preference: the lowest free id
}

TEST(SlotQueue, KeepsArrivalOrderWithSeveralSlots) {
  SlotQueue queue(2);
  SlotQueue::Hold a = queue.acquire();
  SlotQueue::Hold b = queue.acquire();
  // The preference is asked under the queue's lock as a ticket takes its slot: the order
  // of the first calls is the order of acquisition.
  std::vector<int> order;
  std::vector<std::thread> threads;
  for (int i = 0; i < 6; ++i) {
    threads.emplace_back([&, i] {
      bool noted = false;
      SlotQueue::Hold hold = queue.acquire([&](int) {
        if (!noted) order.push_back(i);
        noted = true;
        return size_t{0};
      });
    });
    while (queue.waiting() != static_cast<uint64_t>(i + 3)) std::this_thread::yield();
  }
  a.release();
  b.release();
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4, 5}));
}

TEST(SlotQueue, WaitIdleWaitsOnlyForItsOwnSlotsDecodes) {
  SlotQueue queue(2);
  auto decode = std::make_unique<SlotQueue::Decode>(queue.begin_decode(1));
  EXPECT_TRUE(queue.wait_idle(0, std::chrono::milliseconds(0)));  // slot 1 decodes, slot 0 is idle
  EXPECT_FALSE(queue.wait_idle(1, std::chrono::milliseconds(10)));
  decode.reset();
  EXPECT_TRUE(queue.wait_idle(1, std::chrono::milliseconds(0)));
}

TEST(SlotQueue, CountsTheOtherSlotsWithAReplyInFlight) {
  SlotQueue queue(4);
  EXPECT_EQ(queue.decoding_besides(0), 0);
  auto one = std::make_unique<SlotQueue::Decode>(queue.begin_decode(1));
  SlotQueue::Decode again = queue.begin_decode(1);  // two decodes in one slot: one stream stalled
  SlotQueue::Decode three = queue.begin_decode(3);
  EXPECT_EQ(queue.decoding_besides(0), 2);
  EXPECT_EQ(queue.decoding_besides(1), 1);  // its own slot is not one it would stall
  one.reset();
  EXPECT_EQ(queue.decoding_besides(0), 2);
}

}  // namespace
}  // namespace kvshare::route
