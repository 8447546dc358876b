#include "route/metrics.h"

#include <fmt/format.h>

namespace kvshare::route {
namespace {

std::string join_labels(const std::string& labels, const std::string& extra) {
  if (labels.empty()) return "{" + extra + "}";
  return "{" + labels + "," + extra + "}";
}

std::string number(double value) { return fmt::format("{}", value); }

void render_histograms(std::string& out, const std::string& name, const std::string& help,
                       const std::map<std::string, Histogram>& by_route) {
  out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
  for (const auto& [route, histogram] : by_route) out += histogram.render(name, fmt::format("route=\"{}\"", route));
}

}  // namespace

void Histogram::observe(double value) {
  for (size_t i = 0; i < kMsBuckets.size(); ++i)
    if (value <= kMsBuckets[i]) ++buckets_[i];
  ++count_;
  sum_ += value;
}

std::string Histogram::render(const std::string& name, const std::string& labels) const {
  std::string out;
  for (size_t i = 0; i < kMsBuckets.size(); ++i)
    out +=
        fmt::format("{}_bucket{} {}\n", name, join_labels(labels, "le=\"" + number(kMsBuckets[i]) + "\""), buckets_[i]);
  out += fmt::format("{}_bucket{} {}\n", name, join_labels(labels, "le=\"+Inf\""), count_);
  const std::string plain = labels.empty() ? "" : "{" + labels + "}";
  out += fmt::format("{}_sum{} {}\n", name, plain, number(sum_));
  out += fmt::format("{}_count{} {}\n", name, plain, count_);
  return out;
}

void Metrics::count_handoff(const std::string& route, const std::string& outcome) {
  std::lock_guard lock(mutex_);
  ++handoffs_[{route, outcome}];
}

void Metrics::count_fallback(const std::string& reason) {
  std::lock_guard lock(mutex_);
  ++fallbacks_[reason];
}

void Metrics::count_request(const std::string& endpoint) {
  std::lock_guard lock(mutex_);
  ++requests_[endpoint];
}

void Metrics::count_receiver_restart() {
  std::lock_guard lock(mutex_);
  ++receiver_restarts_;
}

void Metrics::count_remote_prefill(const std::string& host, const std::string& result, unsigned long long bytes) {
  std::lock_guard lock(mutex_);
  ++remote_prefills_[{host, result}];
  remote_bytes_[host] += bytes;
}

void Metrics::count_provider_restart() {
  std::lock_guard lock(mutex_);
  ++provider_restarts_;
}

void Metrics::count_prompt_not_reused() {
  std::lock_guard lock(mutex_);
  ++prompt_not_reused_;
}

void Metrics::count_decision(const std::string& decision, const std::string& label) {
  std::lock_guard lock(mutex_);
  ++decisions_[{decision, label}];
}

void Metrics::count_cached_tokens(size_t n_cached) {
  std::lock_guard lock(mutex_);
  cached_tokens_ += n_cached;
}

void Metrics::count_load_handoff() {
  std::lock_guard lock(mutex_);
  ++load_handoffs_;
}

void Metrics::count_reply_cut(const std::string& by) {
  std::lock_guard lock(mutex_);
  ++replies_cut_[by];
}

void Metrics::observe(const std::string& route, double prefill_ms, double handoff_ms, double first_byte_ms) {
  std::lock_guard lock(mutex_);
  prefill_ms_[route].observe(prefill_ms);
  handoff_ms_[route].observe(handoff_ms);
  first_byte_ms_[route].observe(first_byte_ms);
}

std::string Metrics::render() const {
  std::lock_guard lock(mutex_);
  std::string out;
  out +=
      "# HELP kvshare_requests_total Completion requests received, by endpoint.\n"
      "# TYPE kvshare_requests_total counter\n";
  for (const auto& [endpoint, count] : requests_)
    out += fmt::format("kvshare_requests_total{{endpoint=\"{}\"}} {}\n", endpoint, count);
  out +=
      "# HELP kvshare_handoffs_total Handoffs attempted, by route and outcome (ok: the decoder got the KV; "
      "file_fallback: the shared route was refused and the state file carried it; forwarded: the decoder "
      "prefilled the prompt itself).\n# TYPE kvshare_handoffs_total counter\n";
  for (const auto& [key, count] : handoffs_)
    out += fmt::format("kvshare_handoffs_total{{route=\"{}\",outcome=\"{}\"}} {}\n", key.first, key.second, count);
  out += "# HELP kvshare_fallbacks_total Fallbacks, by reason.\n# TYPE kvshare_fallbacks_total counter\n";
  for (const auto& [reason, count] : fallbacks_)
    out += fmt::format("kvshare_fallbacks_total{{reason=\"{}\"}} {}\n", reason, count);
  out +=
      "# HELP kvshare_handoff_decisions_total Whether serve handed a prompt off or forwarded it to the "
      "decoder, and by which rule (docs/hybrid.md).\n# TYPE kvshare_handoff_decisions_total counter\n";
  for (const auto& [key, count] : decisions_)
    out += fmt::format("kvshare_handoff_decisions_total{{decision=\"{}\",rule=\"{}\"}} {}\n", key.first, key.second,
                       count);
  out +=
      "# HELP kvshare_cached_tokens_total Prompt tokens a handoff left in the decoder's cells instead of "
      "prefilling them again.\n# TYPE kvshare_cached_tokens_total counter\n";
  out += fmt::format("kvshare_cached_tokens_total {}\n", cached_tokens_);
  out +=
      "# HELP kvshare_load_handoffs_total Prompts handed off because other slots were decoding: the decoder's "
      "prefill would have stalled their streams (docs/hybrid.md, \"Under load\").\n"
      "# TYPE kvshare_load_handoffs_total counter\n";
  out += fmt::format("kvshare_load_handoffs_total {}\n", load_handoffs_);
  out +=
      "# HELP kvshare_prompt_not_reused_total Replies whose timings.prompt_n was not 1 after a handoff.\n"
      "# TYPE kvshare_prompt_not_reused_total counter\n";
  out += fmt::format("kvshare_prompt_not_reused_total {}\n", prompt_not_reused_);
  out +=
      "# HELP kvshare_remote_receiver_restarts_total Times serve started the remote receiver again after it "
      "exited (a crash, a kill, a hang it was killed for).\n# TYPE kvshare_remote_receiver_restarts_total counter\n";
  out += fmt::format("kvshare_remote_receiver_restarts_total {}\n", receiver_restarts_);
  out +=
      "# HELP kvshare_remote_prefills_total Remote prefills asked of each prefill host (--prefill-remote), by "
      "result (ok; busy: it answered 503; failed: no answer or another refusal).\n"
      "# TYPE kvshare_remote_prefills_total counter\n";
  for (const auto& [key, count] : remote_prefills_)
    out += fmt::format("kvshare_remote_prefills_total{{host=\"{}\",result=\"{}\"}} {}\n", key.first, key.second, count);
  out +=
      "# HELP kvshare_remote_kv_bytes_total KV bytes each prefill host moved into the decoder's cells.\n"
      "# TYPE kvshare_remote_kv_bytes_total counter\n";
  for (const auto& [host, bytes] : remote_bytes_)
    out += fmt::format("kvshare_remote_kv_bytes_total{{host=\"{}\"}} {}\n", host, bytes);
  out +=
      "# HELP kvshare_provider_restarts_total Times serve started (or reached) a resident provider again after it "
      "lost one (an exit, a kill, a hang it was killed for).\n# TYPE kvshare_provider_restarts_total counter\n";
  out += fmt::format("kvshare_provider_restarts_total {}\n", provider_restarts_);
  out +=
      "# HELP kvshare_replies_cut_total Relayed replies that ended before their last byte, by who cut them "
      "(client: it left; decoder: its stream broke).\n# TYPE kvshare_replies_cut_total counter\n";
  for (const auto& [by, count] : replies_cut_)
    out += fmt::format("kvshare_replies_cut_total{{by=\"{}\"}} {}\n", by, count);
  render_histograms(out, "kvshare_prefill_ms", "The provider's prefill (its own prefill_ms, else wall time).",
                    prefill_ms_);
  render_histograms(out, "kvshare_handoff_ms", "The decoder's restore (file) or share + adopt (shared).", handoff_ms_);
  render_histograms(out, "kvshare_first_byte_ms", "From the start of the handoff to the first byte relayed.",
                    first_byte_ms_);
  return out;
}

}  // namespace kvshare::route
