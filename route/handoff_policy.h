// Whether a request is worth a handoff (issue #23, docs/hybrid.md "When serve hands off").
// A handoff pays a provider run, the share or restore, and the decoder's last token; the
// decoder alone pays only for the prompt tokens its slot does not hold already. In a chat
// most of every later turn is cached, so handing it all over again is many times slower
// than letting the decoder evaluate the new message. Pure: the rates come in, a decision
// and the sentence that explains it go out; serve measures and logs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "layout/error.h"
#include "route/token_rate.h"

namespace kvshare::route {

// --stream-weight's default: one ms of one decoding stream's stall is worth one ms of the
// arriving request's first byte (docs/hybrid.md, "Under load").
inline constexpr double kDefaultStreamWeight = 1.0;

// --handoff: auto (by measured rates), always, never, or N (hand off when at least N of
// the prompt's tokens, its last one aside, are not in the decoder's slot).
enum class HandoffMode { automatic, always, never, threshold };
struct HandoffPolicy {
  HandoffMode mode = HandoffMode::automatic;
  size_t min_tokens = 0;  // threshold only
  // auto only (--stream-weight): how many ms of the arriving request's first byte one ms
  // of one decoding stream's stall is worth; 0 turns the load rule off.
  double stream_weight = kDefaultStreamWeight;
};
// "auto", "always", "never" or a positive decimal count; EINVAL naming the flag otherwise.
Result<HandoffPolicy> parse_handoff_policy(std::string_view text);
std::string handoff_policy_name(const HandoffPolicy& policy);

// Before serve has measured the provider's prompt speed, `auto` hands off when at least
// this many uncached tokens (the last one aside) would be handed over: the first long
// prompt teaches serve the provider's speed.
inline constexpr size_t kDefaultMinHandoffTokens = 256;
// A forwarded reply teaches the decoder's prompt speed, and a provider run the provider's,
// only when it evaluated at least this many tokens: fewer measure the per-call overhead
// and a small batch's inefficiency, not what it takes for a long message.
inline constexpr int64_t kMinRateSampleTokens = 64;
// `auto` compares its estimates only for an uncached part at most this many times the
// decoder's largest measured one; past it, the request is forwarded and measures the decoder
// there (forwarding is what the decoder alone would have done: never slower than it).
inline constexpr size_t kMaxRateReach = 4;
// A handoff must be estimated at most this fraction of the decoder's time: the estimates
// come from other requests' shapes, and in doubt the decoder alone is the promise.
inline constexpr double kHandoffMargin = 0.8;

// What serve has measured so far; nullopt until the first sample.
struct MeasuredRates {
  std::optional<TokenRate> decoder;            // forwarded replies: timings.prompt_ms over prompt_n
  size_t decoder_largest_sample = 0;           // the most tokens one of them evaluated
  std::optional<TokenRate> provider;           // handoffs: the provider's prefill_ms over the tokens it prefilled
  std::optional<double> provider_overhead_ms;  // handoffs: the provider's wall time less its prefill_ms (EWMA)
  std::optional<double> handoff_ms;            // handoffs: share + adopt, or the restore (EWMA)
  std::optional<double> decode_ms_per_token;   // replies: predicted_ms over predicted_n (EWMA)
};

// The rates, shared by every request's thread. The EWMAs weigh the newest sample 1/4.
class RateBook {
 public:
  // A forwarded reply: the decoder evaluated the last `prompt_n` of `n_prompt` tokens.
  void observe_decoder(size_t n_prompt, int64_t prompt_n, double prompt_ms);
  // A provider run: it prefilled `n_prefilled` tokens after `n_cached` it found in place.
  void observe_provider(size_t n_cached, size_t n_prefilled, double prefill_ms, double wall_ms);
  void observe_handoff(double handoff_ms);
  // A reply's generation: `predicted_n` tokens took `predicted_ms` (fewer than 2 say nothing).
  void observe_decode(int64_t predicted_n, double predicted_ms);
  MeasuredRates snapshot() const;

 private:
  mutable std::mutex mutex_;
  TokenRateFit decoder_, provider_;
  MeasuredRates rates_;  // the EWMAs
};

struct HandoffQuestion {
  size_t n_prompt = 0;                // the whole prompt, last token included
  size_t n_cached = 0;                // of it, what the decoder's slot holds (an estimate before the share)
  size_t ctx_size = 0;                // the decoder's context in cells (0: unknown)
  bool provider_incremental = false;  // the provider can prefill from n_cached on (--cached)
  // The load (docs/hybrid.md, "Under load"): the decoder's other slots with a reply in
  // flight, whose every next token waits while the decoder prefills this prompt; and the
  // handoffs ahead of this one at a resident provider (it prefills one request at a time).
  size_t n_decoding = 0;
  size_t provider_queue = 0;
};

struct HandoffDecision {
  bool hand_off = false;
  size_t n_to_prefill = 0;  // the tokens the provider prefills when handing off
  // metric label: threshold, short, faster, load, provider_busy, measuring, always, never, cached, too_long
  std::string label;
  std::string why;  // the log line's words, e.g. "uncached 42 tokens: the decoder is faster"
};

HandoffDecision decide_handoff(const HandoffPolicy& policy, const MeasuredRates& rates,
                               const HandoffQuestion& question);

// The longest common prefix of two id sequences.
size_t common_prefix(std::span<const int32_t> a, std::span<const int32_t> b);

}  // namespace kvshare::route
