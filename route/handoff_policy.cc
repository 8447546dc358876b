#include "route/handoff_policy.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>

namespace kvshare::route {
namespace {

constexpr double kNewestWeight = 0.25;

void blend(std::optional<double>& mean, double sample) {
  mean = mean ? *mean + kNewestWeight * (sample - *mean) : sample;
}

HandoffDecision forward(std::string label, std::string why) { return {false, 0, std::move(label), std::move(why)}; }

}  // namespace

Result<HandoffPolicy> parse_handoff_policy(std::string_view text) {
  if (text == "auto") return HandoffPolicy{HandoffMode::automatic, 0};
  if (text == "always") return HandoffPolicy{HandoffMode::always, 0};
  if (text == "never") return HandoffPolicy{HandoffMode::never, 0};
  size_t count = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), count);
  if (ec != std::errc() || end != text.data() + text.size() || count == 0)
    return fail(EINVAL,
                "--handoff {:?}: give auto, always, never, or the fewest tokens worth a provider run (a "
                "count of 1 or more)",
                std::string(text));
  return HandoffPolicy{HandoffMode::threshold, count};
}

std::string handoff_policy_name(const HandoffPolicy& policy) {
  switch (policy.mode) {
    case HandoffMode::always:
      return "always";
    case HandoffMode::never:
      return "never";
    case HandoffMode::threshold:
      return std::to_string(policy.min_tokens);
    default:
      return "auto";
  }
}

void RateBook::observe_decoder(size_t n_prompt, int64_t prompt_n, double prompt_ms) {
  if (prompt_n < kMinRateSampleTokens || static_cast<size_t>(prompt_n) > n_prompt || !(prompt_ms > 0)) return;
  std::lock_guard lock(mutex_);
  decoder_.add(n_prompt - static_cast<size_t>(prompt_n), static_cast<size_t>(prompt_n), prompt_ms);
}

void RateBook::observe_provider(size_t n_cached, size_t n_prefilled, double prefill_ms, double wall_ms) {
  if (n_prefilled == 0 || !(prefill_ms > 0)) return;
  std::lock_guard lock(mutex_);
  if (n_prefilled >= static_cast<size_t>(kMinRateSampleTokens)) provider_.add(n_cached, n_prefilled, prefill_ms);
  blend(rates_.provider_overhead_ms, std::max(0.0, wall_ms - prefill_ms));
}

void RateBook::observe_handoff(double handoff_ms) {
  if (!(handoff_ms >= 0)) return;
  std::lock_guard lock(mutex_);
  blend(rates_.handoff_ms, handoff_ms);
}

void RateBook::observe_decode(int64_t predicted_n, double predicted_ms) {
  if (predicted_n < 2 || !(predicted_ms > 0)) return;
  std::lock_guard lock(mutex_);
  blend(rates_.decode_ms_per_token, predicted_ms / static_cast<double>(predicted_n));
}

MeasuredRates RateBook::snapshot() const {
  std::lock_guard lock(mutex_);
  MeasuredRates out = rates_;
  out.decoder = decoder_.rate();
  out.decoder_largest_sample = decoder_.largest_sample();
  out.provider = provider_.rate();
  return out;
}

size_t common_prefix(std::span<const int32_t> a, std::span<const int32_t> b) {
  const size_t n = std::min(a.size(), b.size());
  return static_cast<size_t>(std::mismatch(a.begin(), a.begin() + static_cast<std::ptrdiff_t>(n), b.begin()).first -
                             a.begin());
}

HandoffDecision decide_handoff(const HandoffPolicy& policy, const MeasuredRates& rates,
                               const HandoffQuestion& question) {
  const size_t n_prompt = question.n_prompt;
  // The last token is always the decoder's (engine#941): at most n_prompt - 1 are cached.
  const size_t n_cached = n_prompt == 0 ? 0 : std::min(question.n_cached, n_prompt - 1);
  const size_t n_uncached = n_prompt - n_cached;
  if (question.ctx_size != 0 && n_prompt > question.ctx_size)
    return forward("too_long", fmt::format("{} tokens do not fit the decoder's context of {} cells: the decoder "
                                           "answers it as it would alone",
                                           n_prompt, question.ctx_size));
  if (n_uncached <= 1) return forward("cached", "the decoder holds all but the last token");
  if (policy.mode == HandoffMode::never)
    return forward("never", fmt::format("uncached {} tokens: --handoff never", n_uncached));
  const size_t n_to_prefill = question.provider_incremental ? n_uncached - 1 : n_prompt - 1;
  // What a handoff takes off the decoder: the uncached tokens but the last. A count rule
  // weighs that, not what the provider prefills: a provider without --cached (or the file
  // route) prefills the whole prompt, and a chat's short turn is still not worth it.
  const size_t n_handed_over = n_uncached - 1;
  auto hand_off = [&](std::string label, std::string why) {
    return HandoffDecision{true, n_to_prefill, std::move(label), std::move(why)};
  };
  auto by_count = [&](size_t min_tokens, std::string_view rule) {
    if (n_handed_over >= min_tokens)
      return hand_off("threshold", fmt::format("{} uncached tokens to hand over, {}", n_handed_over, rule));
    return forward("short",
                   fmt::format("uncached {} tokens: {} to hand over, below {}", n_uncached, n_handed_over, rule));
  };
  switch (policy.mode) {
    case HandoffMode::always:
      return hand_off("always", "--handoff always");
    case HandoffMode::threshold:
      return by_count(policy.min_tokens, fmt::format("--handoff {}", policy.min_tokens));
    default:
      break;
  }
  // auto. A resident provider prefills one request at a time: a handoff behind another one
  // would wait for it, a wait none of the estimates holds, so the decoder takes this one.
  auto unless_provider_busy = [&](HandoffDecision decision) {
    if (!decision.hand_off || question.provider_queue == 0) return decision;
    return forward("provider_busy",
                   fmt::format("uncached {} tokens: the provider is prefilling {} other request{} (one at a time), "
                               "the decoder evaluates them",
                               n_uncached, question.provider_queue, question.provider_queue == 1 ? "" : "s"));
  };
  if (!rates.provider)
    return unless_provider_busy(by_count(
        kDefaultMinHandoffTokens, fmt::format("{} before the provider's speed is measured", kDefaultMinHandoffTokens)));
  if (!rates.decoder || n_uncached > kMaxRateReach * rates.decoder_largest_sample) {
    if (n_handed_over < kDefaultMinHandoffTokens)
      return forward("short", fmt::format("uncached {} tokens: {} to hand over, below {} before the decoder's speed "
                                          "is measured",
                                          n_uncached, n_handed_over, kDefaultMinHandoffTokens));
    return forward(
        "measuring",
        rates.decoder ? fmt::format("uncached {} tokens: the decoder evaluates them, measuring its speed "
                                    "past the {} tokens it was measured on",
                                    n_uncached, rates.decoder_largest_sample)
                      : fmt::format("uncached {} tokens: the decoder evaluates them, measuring its speed", n_uncached));
  }
  // The decoder alone evaluates every uncached token where it sits; a handoff costs the
  // provider's run (its start-up and exit, then its prefill, from the cached cells on or
  // from 0), the share or restore, and the decoder's evaluation of the last token.
  const double forward_ms = rates.decoder->ms_for(n_cached, n_uncached);
  const size_t prefill_from = question.provider_incremental ? n_cached : 0;
  const double handoff_ms = rates.provider_overhead_ms.value_or(0) +
                            rates.provider->ms_for(prefill_from, n_to_prefill) + rates.handoff_ms.value_or(0) +
                            rates.decoder->ms_for(n_prompt - 1, 1);
  if (handoff_ms <= kHandoffMargin * forward_ms)
    return unless_provider_busy(
        hand_off("faster", fmt::format("uncached {} tokens: the provider is faster (about {:.1f} ms against the "
                                       "decoder's {:.1f} ms)",
                                       n_uncached, handoff_ms, forward_ms)));
  // Under load: llama-server evaluates a prompt in the same steps as the other slots' next
  // tokens, so while it prefills this one every decoding stream waits about forward_ms.
  // An idle provider takes that off the decoder; the price is this request's extra wait
  // (docs/hybrid.md, "Under load").
  const size_t n_decoding = question.n_decoding;
  const double stall_ms = forward_ms * static_cast<double>(n_decoding) * policy.stream_weight;
  const double extra_ms = handoff_ms - forward_ms;
  const bool weighs_load = n_decoding > 0 && question.provider_queue == 0 && policy.stream_weight > 0;
  const std::string slots = fmt::format(
      "{} slot{} decoding{}", n_decoding, n_decoding == 1 ? "" : "s",
      rates.decode_ms_per_token ? fmt::format(" at about {:.1f} ms a token", *rates.decode_ms_per_token) : "");
  if (weighs_load && stall_ms > extra_ms)
    return hand_off("load", fmt::format("{} (decoder about {:.0f} ms would stall {}, provider about {:.0f} ms)", slots,
                                        forward_ms, n_decoding == 1 ? "it" : "them", handoff_ms));
  std::string why = fmt::format(
      "uncached {} tokens: the decoder is about as fast or faster (about {:.1f} ms against {:.1f} ms by the "
      "provider)",
      n_uncached, forward_ms, handoff_ms);
  if (weighs_load)
    why += fmt::format("; {}: their stall weighs about {:.0f} ms, the provider's extra wait {:.0f} ms", slots, stall_ms,
                       extra_ms);
  return forward("faster", std::move(why));
}

}  // namespace kvshare::route
