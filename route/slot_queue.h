// The decoder's slots (llama-server's -np), as serve shares them between concurrent
// requests. A request takes a ticket; tickets get slots in arrival order (a ticket queue,
// not a mutex: std::mutex promises no order), each the free slot the request prefers (the
// one whose cells hold most of its prompt). With one slot a request holds it from its
// handoff until the decoder's first byte; with several, until its reply ends, so the next
// request on that slot never waits for another slot's reply. Separately the queue counts
// each slot's decodes in flight: the shared route's provider writes into the slot's cells
// directly and must not start while an earlier request still decodes from them.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

namespace kvshare::route {

class SlotQueue {
 public:
  explicit SlotQueue(int n_slots = 1);

  // One slot, held until release() (idempotent; the destructor releases).
  class Hold {
   public:
    Hold() = default;
    Hold(Hold&& other) noexcept : queue_(std::exchange(other.queue_, nullptr)), slot_(other.slot_) {}
    Hold& operator=(Hold&& other) noexcept;
    ~Hold() { release(); }
    void release();
    bool held() const { return queue_ != nullptr; }
    int slot() const { return slot_; }  // the slot's id_slot (kept after release)

   private:
    friend class SlotQueue;
    Hold(SlotQueue* queue, int slot) : queue_(queue), slot_(slot) {}
    SlotQueue* queue_ = nullptr;
    int slot_ = 0;
  };

  // One forwarded request's decode in a slot; the destructor ends it.
  class Decode {
   public:
    Decode() = default;
    Decode(Decode&& other) noexcept : queue_(std::exchange(other.queue_, nullptr)), slot_(other.slot_) {}
    Decode& operator=(Decode&& other) noexcept;
    ~Decode();

   private:
    friend class SlotQueue;
    Decode(SlotQueue* queue, int slot) : queue_(queue), slot_(slot) {}
    SlotQueue* queue_ = nullptr;
    int slot_ = 0;
  };

  // How much a request would like slot `slot` (higher is better; ties go to the lowest id).
  using Preference = std::function<size_t(int slot)>;

  // Takes a ticket now and blocks until every earlier ticket has a slot and one is free;
  // then takes the free slot `prefer` scores highest (no preference: the lowest free id).
  Hold acquire(const Preference& prefer = {});
  // Counts a forwarded request in `slot` until the returned object is destroyed.
  Decode begin_decode(int slot = 0);
  // Blocks until no decode is in flight in `slot`, at most `timeout`; false on timeout.
  bool wait_idle(int slot, std::chrono::milliseconds timeout);
  bool wait_idle(std::chrono::milliseconds timeout) { return wait_idle(0, timeout); }

  // Slots other than `slot` with a forwarded request in flight (the decoder prefills or
  // streams its reply): the streams a prefill in `slot` would stall (the load rule).
  int decoding_besides(int slot) const;

  int n_slots() const { return static_cast<int>(busy_.size()); }
  // Tickets taken and not yet released: requests holding a slot or waiting for one.
  uint64_t waiting() const;

 private:
  void release_slot(int slot);
  void end_decode(int slot);

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  uint64_t next_ticket_ = 0;
  uint64_t serving_ = 0;  // the first ticket without a slot
  std::vector<bool> busy_;
  std::vector<int> decodes_in_flight_;
  uint64_t held_ = 0;
};

}  // namespace kvshare::route
