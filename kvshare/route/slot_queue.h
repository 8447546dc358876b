// The decoder's one slot, as serve shares it between concurrent requests: a request holds
// the slot from its handoff until the decoder's first byte, in arrival order (a ticket
// queue, not a mutex: std::mutex promises no order). Separately it counts decodes in
// flight, because the shared route's provider writes into the decoder's cache directly and
// must not start while an earlier request still decodes from those cells.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <utility>

namespace kvshare::route {

class SlotQueue {
 public:
  // Held from the handoff until the decoder's first byte; release() is idempotent and the
  // destructor releases.
  class Hold {
   public:
    Hold() = default;
    Hold(Hold&& other) noexcept : queue_(std::exchange(other.queue_, nullptr)) {}
    Hold& operator=(Hold&& other) noexcept;
    ~Hold() { release(); }
    void release();
    bool held() const { return queue_ != nullptr; }

   private:
    friend class SlotQueue;
    explicit Hold(SlotQueue* queue) : queue_(queue) {}
    SlotQueue* queue_ = nullptr;
  };

  // One forwarded request's decode; the destructor ends it.
  class Decode {
   public:
    Decode() = default;
    Decode(Decode&& other) noexcept : queue_(std::exchange(other.queue_, nullptr)) {}
    Decode& operator=(Decode&& other) noexcept;
    ~Decode();

   private:
    friend class SlotQueue;
    explicit Decode(SlotQueue* queue) : queue_(queue) {}
    SlotQueue* queue_ = nullptr;
  };

  // Takes a ticket now and blocks until every earlier ticket has been released.
  Hold acquire();
  // Counts a forwarded request until the returned object is destroyed.
  Decode begin_decode();
  // Blocks until no decode is in flight, at most `timeout`; false on timeout.
  bool wait_idle(std::chrono::milliseconds timeout);

  uint64_t waiting() const;

 private:
  void release_ticket();
  void end_decode();

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  uint64_t next_ticket_ = 0;
  uint64_t serving_ = 0;
  int decodes_in_flight_ = 0;
};

}  // namespace kvshare::route
