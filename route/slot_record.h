// What serve believes slot 0 holds: the ids of the last prompt it sent there and how many
// tokens the decoder generated after them. An estimate, used only to decide whether a
// request is worth a handoff (route/handoff_policy.h) before anything is asked of
// the decoder: a cell is reused only where the decoder itself says what it holds (its
// share reply's n_cached, or its own prompt cache on a forward).
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <vector>

namespace kvshare::route {

class SlotRecord {
 public:
  // The prompt tokens of `ids` the slot likely holds: their common prefix with the last
  // prompt, and when that prompt is all of it, the tokens generated after it (a chat's
  // next turn begins with the previous prompt and the reply), at most ids.size() - 1.
  size_t estimate_cached(std::span<const int32_t> ids) const;
  // The slot's prompt is now `ids` (handed off or forwarded), nothing generated yet; the
  // id names this prompt for remember_generated.
  uint64_t remember_prompt(std::span<const int32_t> ids);
  // The reply to prompt `prompt_id` generated `n` tokens (its timings.predicted_n). A reply
  // that ends after the next request has taken the slot (the slot is released at the first
  // byte) is about a prompt the slot no longer has last: ignored.
  void remember_generated(uint64_t prompt_id, int64_t n);
  // Nothing is known of the slot (a request serve could not tokenize).
  void forget();

 private:
  mutable std::mutex mutex_;
  std::vector<int32_t> prompt_;
  size_t generated_ = 0;
  uint64_t prompt_id_ = 0;
};

}  // namespace kvshare::route
