#include "route/slot_record.h"

#include <algorithm>

#include "route/handoff_policy.h"

namespace kvshare::route {

size_t SlotRecord::estimate_cached(std::span<const int32_t> ids) const {
  if (ids.empty()) return 0;
  std::lock_guard lock(mutex_);
  size_t cached = common_prefix(prompt_, ids);
  // The reply's own tokens come back rendered in the next turn's prompt; how many of them
  // tokenize the same is for the decoder to say, so the generated count is only a guess.
  if (cached == prompt_.size() && !prompt_.empty()) cached += generated_;
  return std::min(cached, ids.size() - 1);
}

uint64_t SlotRecord::remember_prompt(std::span<const int32_t> ids) {
  std::lock_guard lock(mutex_);
  prompt_.assign(ids.begin(), ids.end());
  generated_ = 0;
  return ++prompt_id_;
}

void SlotRecord::remember_generated(uint64_t prompt_id, int64_t n) {
  std::lock_guard lock(mutex_);
  if (prompt_id != prompt_id_) return;
  generated_ = n > 0 ? static_cast<size_t>(n) : 0;
}

void SlotRecord::forget() {
  std::lock_guard lock(mutex_);
  prompt_.clear();
  generated_ = 0;
  ++prompt_id_;
}

}  // namespace kvshare::route
