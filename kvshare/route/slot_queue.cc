#include "kvshare/route/slot_queue.h"

#include <utility>

namespace kvshare::route {

SlotQueue::Hold& SlotQueue::Hold::operator=(Hold&& other) noexcept {
  if (this != &other) {
    release();
    queue_ = std::exchange(other.queue_, nullptr);
  }
  return *this;
}

void SlotQueue::Hold::release() {
  if (SlotQueue* queue = std::exchange(queue_, nullptr)) queue->release_ticket();
}

SlotQueue::Decode& SlotQueue::Decode::operator=(Decode&& other) noexcept {
  if (this != &other) {
    if (queue_) queue_->end_decode();
    queue_ = std::exchange(other.queue_, nullptr);
  }
  return *this;
}

SlotQueue::Decode::~Decode() {
  if (queue_) queue_->end_decode();
}

SlotQueue::Hold SlotQueue::acquire() {
  std::unique_lock lock(mutex_);
  const uint64_t ticket = next_ticket_++;
  changed_.wait(lock, [&] { return serving_ == ticket; });
  return Hold(this);
}

void SlotQueue::release_ticket() {
  {
    std::lock_guard lock(mutex_);
    ++serving_;
  }
  changed_.notify_all();
}

SlotQueue::Decode SlotQueue::begin_decode() {
  std::lock_guard lock(mutex_);
  ++decodes_in_flight_;
  return Decode(this);
}

void SlotQueue::end_decode() {
  {
    std::lock_guard lock(mutex_);
    --decodes_in_flight_;
  }
  changed_.notify_all();
}

bool SlotQueue::wait_idle(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  return changed_.wait_for(lock, timeout, [&] { return decodes_in_flight_ == 0; });
}

uint64_t SlotQueue::waiting() const {
  std::lock_guard lock(mutex_);
  return next_ticket_ - serving_;
}

}  // namespace kvshare::route
