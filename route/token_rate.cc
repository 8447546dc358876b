#include "route/token_rate.h"

#include <algorithm>

namespace kvshare::route {

double TokenRate::ms_for(size_t from, size_t n) const {
  const double mean_position = static_cast<double>(from) + static_cast<double>(n) / 2;
  return static_cast<double>(n) * (base_ms + per_position_ms * mean_position);
}

void TokenRateFit::add(size_t from, size_t n, double ms) {
  if (n == 0 || !(ms > 0)) return;
  const double x = static_cast<double>(from) + static_cast<double>(n) / 2;
  const double y = ms / static_cast<double>(n);
  w_ = kKeep * w_ + 1;
  wx_ = kKeep * wx_ + x;
  wy_ = kKeep * wy_ + y;
  wxx_ = kKeep * wxx_ + x * x;
  wxy_ = kKeep * wxy_ + x * y;
  largest_ = std::max(largest_, n);
}

std::optional<TokenRate> TokenRateFit::rate() const {
  if (w_ == 0) return std::nullopt;
  const double mean_x = wx_ / w_, mean_y = wy_ / w_;
  const double variance = wxx_ / w_ - mean_x * mean_x;
  const TokenRate flat{mean_y, 0};
  // Samples within a few dozen positions of each other say nothing of a slope.
  constexpr double kMinSpread = 32;
  if (variance < kMinSpread * kMinSpread) return flat;
  const double slope = (wxy_ / w_ - mean_x * mean_y) / variance;
  if (slope <= 0) return flat;  // later tokens do not cost less: noise
  const double base = mean_y - slope * mean_x;
  // A line that would cost nothing before some position passes through the origin instead.
  if (base < 0) return TokenRate{0, mean_y / mean_x};
  return TokenRate{base, slope};
}

}  // namespace kvshare::route
