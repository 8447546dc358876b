// What /metrics reports, in Prometheus' text format (version 0.0.4): handoffs by route and
// outcome, fallbacks by reason, and the three timings of the log line as histograms.
// Thread-safe; every request updates it once.
#pragma once

#include <array>
#include <cstddef>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace kvshare::route {

// Histogram buckets in milliseconds: from a sub-millisecond shared handoff to a minute-long
// NPU prefill.
inline constexpr std::array<double, 14> kMsBuckets = {0.25, 0.5, 1,   2.5, 5,    10,   25,
                                                      50,   100, 250, 500, 1000, 5000, 60000};

class Histogram {
 public:
  void observe(double value);
  // Lines for `name` (buckets, _sum, _count), with `labels` ("" or `route="file"`).
  std::string render(const std::string& name, const std::string& labels) const;

 private:
  std::array<unsigned long long, kMsBuckets.size()> buckets_{};
  unsigned long long count_ = 0;
  double sum_ = 0;
};

class Metrics {
 public:
  // route: "file" | "shared"; outcome: "ok" | "file_fallback" (shared refused, file used)
  // | "forwarded" (handed back to the decoder's own prefill).
  void count_handoff(const std::string& route, const std::string& outcome);
  void count_fallback(const std::string& reason);
  void count_request(const std::string& endpoint);
  void count_prompt_not_reused();
  // Each hybrid request's decision (route/handoff_policy.h): decision "handoff" or
  // "forward", with the rule's label; and the prompt tokens a handoff did not prefill
  // again because the decoder's slot held them (--cached).
  void count_decision(const std::string& decision, const std::string& label);
  void count_cached_tokens(size_t n_cached);
  // A handoff the load rule chose (decision "handoff", rule "load"): the provider took a
  // prefill off a decoder whose other slots were decoding.
  void count_load_handoff();
  // serve started kvshare-remote-receiver again after it had exited.
  void count_receiver_restart();
  // One remote prefill asked of prefill host `host` (its --prefill-remote URL); result:
  // "ok" | "busy" (it answered 503) | "failed" (no answer, or another refusal). `bytes`:
  // the KV bytes it moved into the decoder (ok only).
  void count_remote_prefill(const std::string& host, const std::string& result, unsigned long long bytes = 0);
  // serve started (or reached) a resident provider again after it had lost one.
  void count_provider_restart();
  // A relayed reply that ended before its last byte; by: "client" (it left) | "decoder"
  // (its stream broke).
  void count_reply_cut(const std::string& by);
  // route: "file" | "shared"; handoff_ms is the decoder's restore, or share + adopt.
  void observe(const std::string& route, double prefill_ms, double handoff_ms, double first_byte_ms);

  std::string render() const;

 private:
  mutable std::mutex mutex_;
  std::map<std::pair<std::string, std::string>, unsigned long long> handoffs_;
  std::map<std::string, unsigned long long> fallbacks_;
  std::map<std::string, unsigned long long> requests_;
  std::map<std::pair<std::string, std::string>, unsigned long long> decisions_;
  unsigned long long cached_tokens_ = 0;
  unsigned long long load_handoffs_ = 0;
  unsigned long long prompt_not_reused_ = 0;
  unsigned long long receiver_restarts_ = 0;
  unsigned long long provider_restarts_ = 0;
  std::map<std::string, unsigned long long> replies_cut_;
  std::map<std::pair<std::string, std::string>, unsigned long long> remote_prefills_;
  std::map<std::string, unsigned long long> remote_bytes_;
  std::map<std::string, Histogram> prefill_ms_, handoff_ms_, first_byte_ms_;
};

}  // namespace kvshare::route
