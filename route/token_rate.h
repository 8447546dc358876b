// How long an engine takes per prompt token, as a function of where the token sits: ms per
// token = base + slope x position. Attention reads every cell before a token, so a token
// at position 3000 costs more than one at 300 (it attends over ten times the cells), and a rate
// learned from turn 1 (positions 0..1500) says little of turn 5 (2800..3400) unless the
// position is in it. Fitted by least squares over the samples, the older ones fading
// (route/handoff_policy.h uses it to decide whether a handoff is worth it).
#pragma once

#include <cstddef>
#include <optional>

namespace kvshare::route {

struct TokenRate {
  double base_ms = 0;          // per token at position 0
  double per_position_ms = 0;  // added per token per position; never negative
  // The time to evaluate `n` tokens at positions from..from+n-1.
  double ms_for(size_t from, size_t n) const;
};

class TokenRateFit {
 public:
  // One measurement: `n` tokens at positions from..from+n-1 took `ms`.
  void add(size_t from, size_t n, double ms);
  // nullopt before the first sample. One sample, or samples all at about one position:
  // a flat rate (their mean).
  std::optional<TokenRate> rate() const;
  // The most tokens one sample measured: how far a prediction reaches past what was seen.
  size_t largest_sample() const { return largest_; }

 private:
  // Weighted sums over the samples (x = the mean position, y = ms per token); each new
  // sample multiplies the old weights by kKeep.
  static constexpr double kKeep = 0.75;
  double w_ = 0, wx_ = 0, wy_ = 0, wxx_ = 0, wxy_ = 0;
  size_t largest_ = 0;
};

}  // namespace kvshare::route
