// The samplers of the engine contract.
#include <cmath>
#include <vector>

#include "refmodel/engine.h"

namespace kvshare::refmodel {

int32_t sample_greedy(std::span<const float> logits) {
  int32_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[static_cast<size_t>(best)]) best = static_cast<int32_t>(i);
  return best;
}

int32_t sample_temperature(std::span<const float> logits, float temperature, std::mt19937_64& rng) {
  if (logits.empty()) return 0;
  if (!(temperature > 0.0f)) return sample_greedy(logits);
  const float max = logits[static_cast<size_t>(sample_greedy(logits))];
  std::vector<double> p(logits.size());
  double sum = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    p[i] = std::exp(static_cast<double>(logits[i] - max) / temperature);
    sum += p[i];
  }
  // A uniform draw built from the raw 64-bit output, not std::uniform_real_distribution:
  // the standard leaves that algorithm to the library, and the same seed must give the
  // same ids everywhere.
  const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53 * sum;
  double acc = 0.0;
  for (size_t i = 0; i < p.size(); ++i) {
    acc += p[i];
    if (u < acc) return static_cast<int32_t>(i);
  }
  return static_cast<int32_t>(p.size() - 1);
}

}  // namespace kvshare::refmodel
