#include "route/handoff_policy.h"

#include <gtest/gtest.h>

#include <vector>

#include "route/slot_record.h"

namespace kvshare::route {
namespace {

// Flat rates (the same at every position), the decoder measured on long parts.
MeasuredRates measured(double decoder_ms, double provider_ms, double overhead_ms, double handoff_ms) {
  MeasuredRates rates;
  rates.decoder = TokenRate{decoder_ms, 0};
  rates.decoder_largest_sample = 1 << 20;
  rates.provider = TokenRate{provider_ms, 0};
  rates.provider_overhead_ms = overhead_ms;
  rates.handoff_ms = handoff_ms;
  return rates;
}

HandoffQuestion question(size_t n_prompt, size_t n_cached, bool incremental = true, size_t ctx = 8192) {
  HandoffQuestion q;
  q.n_prompt = n_prompt;
  q.n_cached = n_cached;
  q.ctx_size = ctx;
  q.provider_incremental = incremental;
  return q;
}

TEST(HandoffPolicy, ParsesEveryFormAndNamesTheFlagInARefusal) {
  EXPECT_EQ(parse_handoff_policy("auto")->mode, HandoffMode::automatic);
  EXPECT_EQ(parse_handoff_policy("always")->mode, HandoffMode::always);
  EXPECT_EQ(parse_handoff_policy("never")->mode, HandoffMode::never);
  auto threshold = parse_handoff_policy("64");
  ASSERT_TRUE(threshold);
  EXPECT_EQ(threshold->mode, HandoffMode::threshold);
  EXPECT_EQ(threshold->min_tokens, 64u);
  EXPECT_EQ(handoff_policy_name(*threshold), "64");
  for (const char* bad : {"", "0", "-3", "12x", "sometimes"}) {
    auto refused = parse_handoff_policy(bad);
    ASSERT_FALSE(refused) << bad;
    EXPECT_NE(refused.error().what().find("--handoff"), std::string::npos) << refused.error().what();
  }
}

TEST(HandoffPolicy, ForwardsAShortUncachedPartWhenTheDecoderIsFaster) {
  // A chat's turn 2: 3620 tokens, 3578 cached; the decoder takes 0.5 ms a token, a provider
  // run costs 50 ms before its first token.
  const auto decision = decide_handoff({}, measured(0.5, 0.2, 50, 1), question(3620, 3578));
  EXPECT_FALSE(decision.hand_off);
  EXPECT_EQ(decision.label, "faster");
  EXPECT_NE(decision.why.find("uncached 42 tokens: the decoder is about as fast or faster"), std::string::npos)
      << decision.why;
}

TEST(HandoffPolicy, HandsOffALongUncachedPartAndPrefillsOnlyIt) {
  const auto decision = decide_handoff({}, measured(0.5, 0.2, 50, 1), question(5000, 3000));
  EXPECT_TRUE(decision.hand_off);
  EXPECT_EQ(decision.n_to_prefill, 1999u);  // tokens 3000..4998: the last one is the decoder's
  EXPECT_NE(decision.why.find("the provider is faster"), std::string::npos) << decision.why;
}

TEST(HandoffPolicy, CountsTheWholePromptForAProviderWithoutCached) {
  // Without --cached the provider prefills all 4999 tokens: slower than the decoder's 2000.
  const auto decision = decide_handoff({}, measured(0.5, 0.2, 50, 1), question(5000, 3000, false));
  EXPECT_FALSE(decision.hand_off);
  EXPECT_EQ(decide_handoff({}, measured(0.5, 0.2, 50, 1), question(5000, 0, false)).n_to_prefill, 4999u);
}

TEST(HandoffPolicy, UsesTheDefaultThresholdUntilTheProviderIsMeasured) {
  MeasuredRates decoder_only;
  decoder_only.decoder = TokenRate{0.5, 0};
  decoder_only.decoder_largest_sample = 4096;
  EXPECT_FALSE(decide_handoff({}, {}, question(kDefaultMinHandoffTokens, 0)).hand_off);
  EXPECT_TRUE(decide_handoff({}, {}, question(kDefaultMinHandoffTokens + 1, 0)).hand_off);
  const auto short_one = decide_handoff({}, decoder_only, question(40, 0));
  EXPECT_FALSE(short_one.hand_off);
  EXPECT_EQ(short_one.label, "short");
  EXPECT_NE(short_one.why.find("before the provider's speed is measured"), std::string::npos) << short_one.why;
}

TEST(HandoffPolicy, MeasuresTheDecoderBeforeTrustingAnEstimatePastItsSamples) {
  // A provider 10x faster than the decoder on paper; but the decoder was measured only on
  // 100-token parts (a chat's short turns), and a small batch costs more per token than
  // a long one: its estimate for 609 tokens is not to be trusted. Forwarding measures it,
  // and costs what the decoder alone costs.
  MeasuredRates rates = measured(0.5, 0.05, 20, 1);
  rates.decoder_largest_sample = 100;
  const auto long_part = decide_handoff({}, rates, question(2200, 1591));
  EXPECT_FALSE(long_part.hand_off);
  EXPECT_EQ(long_part.label, "measuring");
  EXPECT_NE(long_part.why.find("past the 100 tokens it was measured on"), std::string::npos) << long_part.why;
  rates.decoder_largest_sample = 200;  // 609 is within 4x of it: the estimate decides
  EXPECT_TRUE(decide_handoff({}, rates, question(2200, 1591)).hand_off);
  // A short part is forwarded as short whatever was measured.
  rates.decoder.reset();
  EXPECT_EQ(decide_handoff({}, rates, question(2200, 2150)).label, "short");
  EXPECT_EQ(decide_handoff({}, rates, question(2200, 1591)).label, "measuring");
}

TEST(HandoffPolicy, ForwardsWhenTheHandoffIsNotClearlySooner) {
  // Turn 5 of the bench's chat with the reference pair (one CPU engine on both sides): the
  // decoder took 61 ms for 609 tokens, the provider 95.9 ms for turn 1's 1518 tokens from
  // 0 plus 20 ms to start; its flat estimate for 608 tokens at 2209 says 58.6 ms, within
  // the margin of the decoder's 61: forwarded (measured: the handoff took 111 ms).
  RateBook book;
  book.observe_decoder(2169, 609, 61.0);
  book.observe_provider(0, 1518, 95.9, 115.9);
  book.observe_handoff(0.1);
  const auto decision = decide_handoff({}, book.snapshot(), question(2819, 2209));
  EXPECT_FALSE(decision.hand_off) << decision.why;
  EXPECT_EQ(decision.label, "faster");
}

TEST(HandoffPolicy, CountsWhatTheDecoderWouldEvaluateNotWhatAWholePrefillCosts) {
  // The file route (no --cached) would prefill all 4999 tokens of a chat's turn 2, whose
  // 20 uncached tokens the decoder evaluates faster itself: a count rule forwards it.
  HandoffPolicy at_least_64{HandoffMode::threshold, 64};
  const auto short_turn = decide_handoff(at_least_64, {}, question(5000, 4980, false));
  EXPECT_FALSE(short_turn.hand_off);
  EXPECT_NE(short_turn.why.find("uncached 20 tokens: 19 to hand over, below --handoff 64"), std::string::npos)
      << short_turn.why;
  EXPECT_FALSE(decide_handoff({}, {}, question(5000, 4980, false)).hand_off);
  const auto long_turn = decide_handoff(at_least_64, {}, question(5000, 4900, false));
  EXPECT_TRUE(long_turn.hand_off);
  EXPECT_EQ(long_turn.n_to_prefill, 4999u);  // the whole prompt but its last token
}

TEST(HandoffPolicy, PinnedPoliciesIgnoreTheRates) {
  const MeasuredRates slow_provider = measured(0.01, 100, 5000, 10);
  HandoffPolicy always{HandoffMode::always, 0};
  HandoffPolicy never{HandoffMode::never, 0};
  HandoffPolicy at_least_10{HandoffMode::threshold, 10};
  EXPECT_TRUE(decide_handoff(always, slow_provider, question(20, 0)).hand_off);
  EXPECT_FALSE(decide_handoff(never, measured(100, 0.01, 0, 0), question(4000, 0)).hand_off);
  EXPECT_TRUE(decide_handoff(at_least_10, slow_provider, question(11, 0)).hand_off);  // 10 to prefill
  const auto below = decide_handoff(at_least_10, {}, question(10, 0));
  EXPECT_FALSE(below.hand_off);
  EXPECT_NE(below.why.find("below --handoff 10"), std::string::npos) << below.why;
}

TEST(HandoffPolicy, NeverHandsOffAPromptThatDoesNotFitOrIsAllCached) {
  HandoffPolicy always{HandoffMode::always, 0};
  const auto too_long = decide_handoff(always, {}, question(7691, 0, true, 4096));
  EXPECT_FALSE(too_long.hand_off);
  EXPECT_EQ(too_long.label, "too_long");
  EXPECT_NE(too_long.why.find("7691 tokens do not fit the decoder's context of 4096 cells"), std::string::npos);
  const auto cached = decide_handoff(always, {}, question(100, 99));
  EXPECT_FALSE(cached.hand_off);
  EXPECT_EQ(cached.label, "cached");
  // An estimate past the prompt is capped: the last token is always the decoder's.
  EXPECT_FALSE(decide_handoff(always, {}, question(100, 500)).hand_off);
}

// The box (#43): a 2300-token prompt, the decoder about 1.06 ms a token, the
// provider (the NPU analog) slower, 1.3 ms a token: about 2438 ms against 3015.
MeasuredRates slower_provider() { return measured(1.06, 1.3, 20, 5); }

HandoffQuestion under_load(size_t n_decoding, size_t provider_queue = 0) {
  HandoffQuestion q = question(2300, 0);
  q.n_decoding = n_decoding;
  q.provider_queue = provider_queue;
  return q;
}

TEST(HandoffPolicyUnderLoad, HandsOffToAnIdleSlowerProviderWhileOtherSlotsDecode) {
  // Before #43 the decoder took it (it is sooner for this request) and froze three streams
  // for two seconds.
  const auto decision = decide_handoff({}, slower_provider(), under_load(3));
  EXPECT_TRUE(decision.hand_off) << decision.why;
  EXPECT_EQ(decision.label, "load");
  EXPECT_EQ(decision.n_to_prefill, 2299u);
  EXPECT_EQ(decision.why, "3 slots decoding (decoder about 2438 ms would stall them, provider about 3015 ms)");
}

TEST(HandoffPolicyUnderLoad, ForwardsToASlowerProviderWhenNoOtherSlotDecodes) {
  const auto decision = decide_handoff({}, slower_provider(), under_load(0));
  EXPECT_FALSE(decision.hand_off);
  EXPECT_EQ(decision.label, "faster");
  EXPECT_EQ(decision.why.find("decoding"), std::string::npos) << decision.why;
}

TEST(HandoffPolicyUnderLoad, ForwardsWhatABusyResidentProviderWouldQueue) {
  // A provider faster than the decoder: on an idle one the estimates hand off; behind
  // another request's prefill it would wait a time no estimate holds.
  const auto idle = decide_handoff({}, measured(0.5, 0.2, 50, 1), question(5000, 3000));
  ASSERT_TRUE(idle.hand_off);
  HandoffQuestion behind_one = question(5000, 3000);
  behind_one.provider_queue = 1;
  const auto busy = decide_handoff({}, measured(0.5, 0.2, 50, 1), behind_one);
  EXPECT_FALSE(busy.hand_off);
  EXPECT_EQ(busy.label, "provider_busy");
  EXPECT_NE(busy.why.find("the provider is prefilling 1 other request (one at a time)"), std::string::npos) << busy.why;
  // So is the first long prompt, before the provider's speed is measured.
  const auto unmeasured = decide_handoff({}, {}, under_load(0, 2));
  EXPECT_FALSE(unmeasured.hand_off);
  EXPECT_EQ(unmeasured.label, "provider_busy");
  // And the load rule does not send streams' work to a provider with a queue.
  EXPECT_FALSE(decide_handoff({}, slower_provider(), under_load(3, 1)).hand_off);
}

TEST(HandoffPolicyUnderLoad, StreamWeightZeroIsTodaysRule) {
  HandoffPolicy unweighted;
  unweighted.stream_weight = 0;
  const auto loaded = decide_handoff(unweighted, slower_provider(), under_load(3));
  const auto idle = decide_handoff(unweighted, slower_provider(), under_load(0));
  EXPECT_FALSE(loaded.hand_off);
  EXPECT_EQ(loaded.label, idle.label);
  EXPECT_EQ(loaded.why, idle.why);
}

TEST(HandoffPolicyUnderLoad, WeighsTheStreamsStallAgainstTheArrivalsExtraWait) {
  // One stream, worth a tenth: a stall of about 244 ms against 577 ms more to first byte.
  HandoffPolicy light;
  light.stream_weight = 0.1;
  const auto forwarded = decide_handoff(light, slower_provider(), under_load(1));
  EXPECT_FALSE(forwarded.hand_off);
  EXPECT_NE(forwarded.why.find("1 slot decoding: their stall weighs about 244 ms, the provider's extra wait 577 ms"),
            std::string::npos)
      << forwarded.why;
  const auto one_stream = decide_handoff({}, slower_provider(), under_load(1));
  EXPECT_TRUE(one_stream.hand_off);
  EXPECT_NE(one_stream.why.find("1 slot decoding (decoder about 2438 ms would stall it,"), std::string::npos)
      << one_stream.why;
  // A provider four times slower than the decoder costs the arrival more than three
  // streams' stall is worth.
  EXPECT_FALSE(decide_handoff({}, measured(1.06, 5.0, 20, 5), under_load(3)).hand_off);
}

TEST(HandoffPolicyUnderLoad, NamesTheStreamsPaceWhenMeasured) {
  MeasuredRates rates = slower_provider();
  rates.decode_ms_per_token = 8.7;
  const auto decision = decide_handoff({}, rates, under_load(3));
  EXPECT_EQ(decision.why.rfind("3 slots decoding at about 8.7 ms a token (decoder about 2438 ms", 0), 0u)
      << decision.why;
}

TEST(HandoffPolicyUnderLoad, LeavesPinnedPoliciesAndUnmeasuredDecodersAlone) {
  HandoffPolicy always{HandoffMode::always, 0};
  EXPECT_TRUE(decide_handoff(always, slower_provider(), under_load(0, 3)).hand_off);  // queues, as asked
  HandoffPolicy never{HandoffMode::never, 0};
  EXPECT_FALSE(decide_handoff(never, slower_provider(), under_load(3)).hand_off);
  // Without the decoder's speed the stall cannot be weighed: the decoder measures it.
  MeasuredRates unmeasured = slower_provider();
  unmeasured.decoder.reset();
  EXPECT_EQ(decide_handoff({}, unmeasured, under_load(3)).label, "measuring");
}

TEST(RateBook, LearnsTheProvidersSpeedOnlyFromRunsLongEnoughToMeasureIt) {
  // #43: a stream's 21-token prompt, handed off while the provider shared its cores with two
  // streams, took 1311 ms; as a rate it made the next 474-token prompt look 17 s away.
  RateBook book;
  book.observe_provider(0, 474, 505, 510);
  book.observe_provider(0, kMinRateSampleTokens - 1, 1311, 1320);
  EXPECT_NEAR(book.snapshot().provider->ms_for(0, 474), 505, 1e-9);
  EXPECT_DOUBLE_EQ(*book.snapshot().provider_overhead_ms, 5 + 0.25 * (9 - 5));  // its start-up still counts
}

TEST(RateBook, LearnsTheStreamsPaceFromReplies) {
  RateBook book;
  book.observe_decode(1, 50);  // one token says nothing of a pace
  EXPECT_FALSE(book.snapshot().decode_ms_per_token);
  book.observe_decode(64, 640);
  EXPECT_DOUBLE_EQ(*book.snapshot().decode_ms_per_token, 10);
  book.observe_decode(10, 60);  // the newest weighs a quarter
  EXPECT_DOUBLE_EQ(*book.snapshot().decode_ms_per_token, 9);
}

TEST(RateBook, LearnsOnlyFromSamplesThatMeasureSpeed) {
  RateBook book;
  book.observe_decoder(1000, kMinRateSampleTokens - 1, 100);  // a few tokens: overhead, not speed
  EXPECT_FALSE(book.snapshot().decoder);
  book.observe_decoder(1000, 1001, 100);  // more evaluated than the prompt has: not a sample
  EXPECT_FALSE(book.snapshot().decoder);
  book.observe_decoder(1000, 100, 50);
  EXPECT_DOUBLE_EQ(book.snapshot().decoder->base_ms, 0.5);
  EXPECT_EQ(book.snapshot().decoder_largest_sample, 100u);
  book.observe_provider(0, 200, 40, 90);
  EXPECT_DOUBLE_EQ(book.snapshot().provider->ms_for(0, 200), 40);
  EXPECT_DOUBLE_EQ(*book.snapshot().provider_overhead_ms, 50);
  book.observe_provider(0, 0, 10, 20);  // nothing prefilled: no rate
  EXPECT_DOUBLE_EQ(book.snapshot().provider->ms_for(0, 200), 40);
  book.observe_handoff(2);
  book.observe_handoff(6);  // the newest weighs a quarter
  EXPECT_DOUBLE_EQ(*book.snapshot().handoff_ms, 3);
}

TEST(TokenRateFit, LearnsThatLaterPositionsCostMore) {
  // The reference provider on the tiny model, turn by turn of a chat (ms for n tokens from
  // position P): the cost per token grows with the position.
  TokenRateFit fit;
  EXPECT_FALSE(fit.rate());
  fit.add(0, 1518, 95.9);
  ASSERT_TRUE(fit.rate());
  EXPECT_DOUBLE_EQ(fit.rate()->per_position_ms, 0);  // one sample: flat
  fit.add(1559, 609, 68.0);
  fit.add(2209, 609, 87.6);
  const TokenRate rate = *fit.rate();
  EXPECT_GT(rate.per_position_ms, 0);
  // The next turn, 609 tokens from 2859, took 108.2 ms: predicted within 10%, where the
  // mean rate of the samples says 75 ms.
  EXPECT_NEAR(rate.ms_for(2859, 609), 108.2, 10.8);
  EXPECT_EQ(fit.largest_sample(), 1518u);
}

TEST(TokenRateFit, TreatsAFallingCostOrOnePositionAsFlat) {
  TokenRateFit fit;
  fit.add(1000, 100, 20);  // 0.2 ms per token at 1050
  fit.add(1010, 100, 30);  // 0.3 at 1060: too close for a slope
  EXPECT_DOUBLE_EQ(fit.rate()->per_position_ms, 0);
  TokenRateFit falling;
  falling.add(0, 100, 30);
  falling.add(3000, 100, 10);
  EXPECT_DOUBLE_EQ(falling.rate()->per_position_ms, 0);
  EXPECT_GT(falling.rate()->base_ms, 0.1);
  EXPECT_LT(falling.rate()->base_ms, 0.3);
  fit.add(0, 0, 5);   // nothing measured
  fit.add(0, 10, 0);  // no time
  EXPECT_EQ(fit.largest_sample(), 100u);
}

TEST(SlotRecord, EstimatesThePreviousPromptAndItsReplyAsCached) {
  SlotRecord record;
  const std::vector<int32_t> turn1 = {1, 2, 3, 4};
  EXPECT_EQ(record.estimate_cached(turn1), 0u);
  const uint64_t turn1_id = record.remember_prompt(turn1);
  record.remember_generated(turn1_id, 3);
  const std::vector<int32_t> turn2 = {1, 2, 3, 4, 9, 9, 9, 5, 6, 7};
  EXPECT_EQ(record.estimate_cached(turn2), 7u);  // 4 prompt tokens, 3 generated
  const std::vector<int32_t> edited = {1, 2, 8, 4, 9};
  EXPECT_EQ(record.estimate_cached(edited), 2u);  // diverges at token 2: the reply is not counted
  const std::vector<int32_t> shorter = {1, 2, 3, 4, 9};
  EXPECT_EQ(record.estimate_cached(shorter), 4u);  // never the last token
  record.forget();
  EXPECT_EQ(record.estimate_cached(turn2), 0u);
}

TEST(SlotRecord, IgnoresAReplyThatEndsAfterTheNextPromptTookTheSlot) {
  // The slot is released at a reply's first byte: the next request may record its prompt
  // before the earlier reply's timings arrive. Its count is not the new prompt's.
  SlotRecord record;
  const std::vector<int32_t> first = {1, 2, 3};
  const std::vector<int32_t> second = {1, 2, 3, 7, 8};
  const uint64_t first_id = record.remember_prompt(first);
  const uint64_t second_id = record.remember_prompt(second);
  record.remember_generated(first_id, 40);
  const std::vector<int32_t> next = {1, 2, 3, 7, 8, 9, 9, 9, 9, 9, 9};
  EXPECT_EQ(record.estimate_cached(next), 5u);  // second's 5 tokens, none of first's 40
  record.remember_generated(second_id, 2);
  EXPECT_EQ(record.estimate_cached(next), 7u);
}

}  // namespace
}  // namespace kvshare::route
