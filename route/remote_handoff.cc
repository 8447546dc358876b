#include "route/remote_handoff.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <string>
#include <utility>

#include "layout/receiver_message.h"
#include "route/decoder_client.h"
#include "route/remote_receiver_process.h"

namespace kvshare::route {
namespace {

using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

using Attempt = HostAttempt;

Attempt not_the_hosts(StepResult result) { return Attempt{std::move(result), false, false}; }

// A receiver that could not do what was asked, or that is gone (ESRCH: then it was reaped).
std::string receiver_failed(const Error& error) {
  return error.errno_value() == ESRCH ? std::string("remote_receiver_died") : std::string("remote_receiver_failed");
}

class RemoteAttempt {
 public:
  RemoteAttempt(const HandoffContext& context, std::span<const int32_t> handoff_ids, HandoffReport& report, size_t host)
      : context_(context),
        config_(*context.config),
        receiver_(*context.remote_receiver),
        hosts_(*context.prefill_hosts),
        handoff_ids_(handoff_ids),
        report_(report),
        host_(host),
        // Safety nets for a busy machine, not measurements: each bounds a wait the receiver
        // has its own, shorter bound for (the decoder's message, the completion, the drain).
        call_timeout_(std::max(context.handshake_timeout, std::chrono::milliseconds(60000))) {}

  Attempt run(const std::string& socket_name);

 private:
  Result<layout::ReceiverReply> ask(const layout::ReceiverRequest& request) {
    auto reply = receiver_.call(request, call_timeout_);
    if (!reply) return fail(reply.error());
    if (!reply->ok)
      return fail(reply->error_errno == 0 ? EIO : reply->error_errno, "the remote receiver refused to {}: {}",
                  layout::receiver_op_name(request.op), reply->error);
    return reply;
  }
  // Drops the receiver's socket (and any grant) when the share does not come to a handoff.
  void drop(const std::string& why) {
    layout::ReceiverRequest revoke;
    revoke.op = layout::ReceiverOp::revoke;
    revoke.socket_name = socket_name_;
    revoke.grant_id = grant_id_;
    revoke.why = why;
    (void)receiver_.call(revoke, call_timeout_);
  }
  // From the grant on a peer may have written the granted cells: revoke (or kill the
  // receiver), then erase the slot.
  Attempt after_grant(std::string reason, std::string why, bool host_at_fault, bool host_busy = false) {
    layout::ReceiverRequest revoke;
    revoke.op = layout::ReceiverOp::revoke;
    revoke.socket_name = socket_name_;
    revoke.grant_id = grant_id_;
    revoke.why = "the handoff failed";
    if (auto revoked = receiver_.call(revoke, call_timeout_); !revoked) {
      reason = receiver_failed(revoked.error());
      why = fmt::format("{}; {}", why, revoked.error().what());
      host_at_fault = false;
    }
    const bool erased = erase_slot(context_, report_.slot);
    return Attempt{forward_because(std::move(reason), std::move(why), !erased), host_at_fault, host_busy};
  }
  Result<size_t> cached_in(const SlotReply& shared) const;
  // The decoder adopts the share: cells 0..n_cached-1 it kept, the rest a host wrote.
  Attempt adopt(const SlotReply& shared, uint64_t share_id, size_t n_cached, double share_wall_ms,
                Clock::time_point adopt_start) {
    auto adopted = adopt_cells(context_, report_.slot, handoff_ids_, share_id, adopt_start, n_cached);
    if (!adopted) return not_the_hosts(std::move(adopted.error()));
    receiver_.note_success();
    report_.phases.handoff_ms = ms_since(adopt_start);
    report_.handoff_ms = shared.timings_ms().value_or(share_wall_ms) + *adopted;
    return not_the_hosts({Step::handed_off, "", ""});
  }

  const HandoffContext& context_;
  const ServeConfig& config_;
  RemoteReceiverProcess& receiver_;
  PrefillHosts& hosts_;
  std::span<const int32_t> handoff_ids_;
  HandoffReport& report_;
  size_t host_;
  std::chrono::milliseconds call_timeout_;
  std::string socket_name_;
  uint64_t grant_id_ = 0;
};

// How many of the ids the decoder's slot holds and keeps, from the share reply (a decoder
// that does not know the field holds none).
Result<size_t> RemoteAttempt::cached_in(const SlotReply& shared) const {
  const auto held = shared.body.find("n_cached");
  if (held == shared.body.end()) return size_t{0};
  if (!held->is_number_unsigned() || held->get<uint64_t>() > handoff_ids_.size())
    return fail(EPROTO, "the share reply's n_cached {} is not a count of at most the {} tokens handed over",
                held->dump(), handoff_ids_.size());
  return static_cast<size_t>(held->get<uint64_t>());
}

Attempt RemoteAttempt::run(const std::string& socket_name) {
  const std::string& url = hosts_.url(host_);
  if (auto up = receiver_.ensure_running(); !up)
    return not_the_hosts({Step::take_file_route,
                          up.error().errno_value() == EAGAIN ? "remote_receiver_restarting" : "remote_receiver_died",
                          up.error().what()});
  layout::ReceiverRequest listen;
  listen.op = layout::ReceiverOp::listen;
  listen.socket_name = socket_name;
  auto listening = ask(listen);
  if (!listening)
    return not_the_hosts({Step::take_file_route, receiver_failed(listening.error()), listening.error().what()});
  socket_name_ = socket_name;
  if (!context_.slot->wait_idle(report_.slot, provider_timeout(config_))) {
    drop("the decoder is busy");
    return not_the_hosts({Step::take_file_route, "decoder_busy", "the decoder is still generating an earlier reply"});
  }
  const auto share_start = Clock::now();
  // With the ids the decoder answers how many its slot holds (n_cached) and keeps those
  // cells: the grant covers only the rest, and only the rest crosses the network.
  auto shared = context_.decoder->slot_action(
      "share", Json{{"socket", listening->socket_path}, {"tokens", ids_json(handoff_ids_)}}, report_.slot);
  if (!shared) {
    drop("the decoder did not share");
    return not_the_hosts({Step::take_file_route, "handshake_failed", shared.error().what()});
  }
  if (!shared->ok()) {
    drop("the decoder did not share");
    return not_the_hosts({Step::take_file_route, "share_refused",
                          fmt::format("the decoder refused to share ({}: {})", shared->status, shared->error_message)});
  }
  auto n_cached = cached_in(*shared);
  if (!n_cached) {
    drop("the share reply was malformed");
    return not_the_hosts({Step::take_file_route, "handshake_failed", n_cached.error().what()});
  }
  report_.n_cached = *n_cached;
  report_.n_prefilled = 0;
  report_.remote_host = url;
  report_.kv_bytes = 0;
  if (*n_cached == handoff_ids_.size()) {
    // The slot holds every id: nothing to write, no host asked.
    drop("the slot holds the whole prompt");
    report_.remote_host.clear();
    const double share_wall_ms = ms_since(share_start);
    report_.phases.share_ms = share_wall_ms;
    if (!shared->body.contains("share_id") || !shared->body["share_id"].is_number_unsigned())
      return not_the_hosts({Step::take_file_route, "handshake_failed", "the share reply has no share_id"});
    return adopt(*shared, shared->body["share_id"].get<uint64_t>(), *n_cached, share_wall_ms, Clock::now());
  }
  layout::ReceiverRequest grant;
  grant.op = layout::ReceiverOp::grant;
  grant.socket_name = socket_name;
  grant.n_cells = static_cast<uint32_t>(handoff_ids_.size());
  grant.n_cached = static_cast<uint32_t>(*n_cached);
  grant.timeout_ms = static_cast<uint64_t>(provider_timeout(config_).count());
  auto granted = ask(grant);
  const double share_wall_ms = ms_since(share_start);
  report_.phases.share_ms = share_wall_ms;
  if (!granted) {
    drop("the decoder's share did not reach a grant");
    return not_the_hosts({Step::take_file_route, receiver_failed(granted.error()),
                          fmt::format("the decoder's share did not reach a grant ({})", granted.error().what())});
  }
  grant_id_ = granted->offer.value("share_id", uint64_t{0});
  // The message on the receiver's socket must be the share this request asked for.
  if (!shared->body.contains("share_id") || !shared->body["share_id"].is_number_unsigned() ||
      shared->body["share_id"].get<uint64_t>() != granted->share_id) {
    drop("the share message is not this request's");
    return not_the_hosts({Step::take_file_route, "handshake_failed",
                          fmt::format("the share reply says share_id {}, the message the receiver took says {}",
                                      shared->body.value("share_id", Json()).dump(), granted->share_id)});
  }
  const uint64_t share_id = granted->share_id;

  PrefillHosts::Lease lease(hosts_, host_);
  const auto& address = hosts_.address(host_);
  const DecoderClient provider(address.host, address.port, provider_timeout(config_), config_.prefill_remote_key);
  const Json prefill_body = {{"tokens", ids_json(handoff_ids_)}, {"share", granted->offer}};
  const auto prefill_start = Clock::now();
  auto prefilled = provider.post_json("/prefill", prefill_body.dump());
  const double prefill_wall_ms = ms_since(prefill_start);
  report_.prefill_ms = prefill_wall_ms;
  report_.phases.provider_ms = prefill_wall_ms;
  if (!prefilled)
    return after_grant("remote_provider_failed",
                       fmt::format("the prefill host {} did not answer: {}", url, prefilled.error().what()), true);
  if (prefilled->status != 200)
    return after_grant(
        prefilled->status == 503 ? "remote_provider_busy" : "remote_provider_failed",
        fmt::format("the prefill host {} answered {}: {}", url, prefilled->status, error_message_of(prefilled->body)),
        true, prefilled->status == 503);
  const Json answer = Json::parse(prefilled->body, nullptr, false);
  if (answer.is_object() && answer.contains("prefill_ms") && answer["prefill_ms"].is_number())
    report_.prefill_ms = answer["prefill_ms"].get<double>();
  if (answer.is_object() && answer.contains("bytes_sent") && answer["bytes_sent"].is_number_unsigned())
    report_.kv_bytes = answer["bytes_sent"].get<uint64_t>();
  // The host attends over the whole prompt: it computed every position but those its
  // session cache held ("reused"), whatever it then sent.
  size_t reused = 0;
  if (answer.is_object() && answer.contains("reused") && answer["reused"].is_number_unsigned())
    reused = std::min<size_t>(answer["reused"].get<uint64_t>(), handoff_ids_.size());
  report_.n_prefilled = handoff_ids_.size() - reused;
  context_.rates.observe_provider(reused, handoff_ids_.size() - reused, report_.prefill_ms, prefill_wall_ms);

  layout::ReceiverRequest complete;
  complete.op = layout::ReceiverOp::complete;
  complete.grant_id = grant_id_;
  complete.n_tokens = static_cast<uint32_t>(handoff_ids_.size());
  const auto adopt_start = Clock::now();
  auto completed = receiver_.call(complete, call_timeout_);
  if (!completed) return after_grant(receiver_failed(completed.error()), completed.error().what(), false);
  // The receiver found the provider's transfer wanting (partial, a refused write, the byte
  // count): the host's fault.
  if (!completed->ok)
    return after_grant("remote_transfer_refused",
                       fmt::format("the remote receiver refused the transfer from {}: {}", url, completed->error),
                       true);
  return adopt(*shared, share_id, *n_cached, share_wall_ms, adopt_start);
}

}  // namespace

StepResult walk_prefill_hosts(const HandoffContext& context, HandoffReport& report,
                              const std::function<HostAttempt(size_t host, size_t index)>& attempt,
                              bool last_fault_takes_local_route) {
  PrefillHosts& hosts = *context.prefill_hosts;
  const std::vector<size_t> order = hosts.order(report.slot);
  StepResult last{Step::take_file_route, "remote_no_host", "no prefill host is configured"};
  for (size_t i = 0; i < order.size(); ++i) {
    const size_t host = order[i];
    HostAttempt tried = attempt(host, i);
    if (tried.result.step == Step::handed_off) {
      hosts.note_success(host, report.slot);
      context.metrics->count_remote_prefill(hosts.url(host), "ok", report.kv_bytes);
      return tried.result;
    }
    if (!tried.host_at_fault) return tried.result;
    hosts.note_failure(host);
    context.metrics->count_remote_prefill(hosts.url(host), tried.host_busy ? "busy" : "failed");
    // A slot that could not be erased must not be shared again.
    if (tried.result.slot_may_be_stale) return tried.result;
    if (i + 1 == order.size()) {
      if (last_fault_takes_local_route) tried.result.step = Step::take_file_route;
      return tried.result;
    }
    context.metrics->count_fallback(tried.result.reason);
    context.log(fmt::format("hybrid: prefill host {} failed ({}): {}; trying {}", hosts.url(host), tried.result.reason,
                            tried.result.why, hosts.url(order[i + 1])));
    last = std::move(tried.result);
  }
  return last;
}

StepResult remote_handoff(const HandoffContext& context, std::span<const int32_t> handoff_ids, uint64_t sequence,
                          HandoffReport& report) {
  // The slot is erased and no grant is open after a host's fault: the last host's fault
  // leaves the local provider's route (if serve has one) as safe as it was before the first share.
  return walk_prefill_hosts(
      context, report,
      [&](size_t host, size_t index) {
        RemoteAttempt attempt(context, handoff_ids, report, host);
        return attempt.run(fmt::format("kvshare-remote-{}-{}.sock", sequence, index));
      },
      true);
}

}  // namespace kvshare::route
