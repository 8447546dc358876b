#include "kvshare/route/slot_queue.h"

#include <gtest/gtest.h>

#include <atomic>
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

}  // namespace
}  // namespace kvshare::route
