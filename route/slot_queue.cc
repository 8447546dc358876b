#include "route/slot_queue.h"

#include <algorithm>
#include <utility>

namespace kvshare::route {

SlotQueue::SlotQueue(int n_slots)
    : busy_(static_cast<size_t>(std::max(n_slots, 1)), false),
      decodes_in_flight_(static_cast<size_t>(std::max(n_slots, 1)), 0) {}

SlotQueue::Hold& SlotQueue::Hold::operator=(Hold&& other) noexcept {
  if (this != &other) {
    release();
    queue_ = std::exchange(other.queue_, nullptr);
    slot_ = other.slot_;
  }
  return *this;
}

void SlotQueue::Hold::release() {
  if (SlotQueue* queue = std::exchange(queue_, nullptr)) queue->release_slot(slot_);
}

SlotQueue::Decode& SlotQueue::Decode::operator=(Decode&& other) noexcept {
  if (this != &other) {
    if (queue_) queue_->end_decode(slot_);
    queue_ = std::exchange(other.queue_, nullptr);
    slot_ = other.slot_;
  }
  return *this;
}

SlotQueue::Decode::~Decode() {
  if (queue_) queue_->end_decode(slot_);
}

SlotQueue::Hold SlotQueue::acquire(const Preference& prefer) {
  std::unique_lock lock(mutex_);
  const uint64_t ticket = next_ticket_++;
  auto any_free = [&] { return std::find(busy_.begin(), busy_.end(), false) != busy_.end(); };
  changed_.wait(lock, [&] { return serving_ == ticket && any_free(); });
  int chosen = -1;
  size_t best = 0;
  for (int slot = 0; slot < n_slots(); ++slot) {
    if (busy_[static_cast<size_t>(slot)]) continue;
    const size_t score = prefer ? prefer(slot) : 0;
    if (chosen < 0 || score > best) {
      chosen = slot;
      best = score;
    }
  }
  busy_[static_cast<size_t>(chosen)] = true;
  ++serving_;
  ++held_;
  lock.unlock();
  changed_.notify_all();  // the next ticket may take another free slot
  return Hold(this, chosen);
}

void SlotQueue::release_slot(int slot) {
  {
    std::lock_guard lock(mutex_);
    busy_[static_cast<size_t>(slot)] = false;
    --held_;
  }
  changed_.notify_all();
}

SlotQueue::Decode SlotQueue::begin_decode(int slot) {
  std::lock_guard lock(mutex_);
  ++decodes_in_flight_[static_cast<size_t>(slot)];
  return Decode(this, slot);
}

void SlotQueue::end_decode(int slot) {
  {
    std::lock_guard lock(mutex_);
    --decodes_in_flight_[static_cast<size_t>(slot)];
  }
  changed_.notify_all();
}

bool SlotQueue::wait_idle(int slot, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  return changed_.wait_for(lock, timeout, [&] { return decodes_in_flight_[static_cast<size_t>(slot)] == 0; });
}

int SlotQueue::decoding_besides(int slot) const {
  std::lock_guard lock(mutex_);
  int count = 0;
  for (int other = 0; other < n_slots(); ++other)
    if (other != slot && decodes_in_flight_[static_cast<size_t>(other)] > 0) ++count;
  return count;
}

uint64_t SlotQueue::waiting() const {
  std::lock_guard lock(mutex_);
  return next_ticket_ - serving_ + held_;
}

}  // namespace kvshare::route
