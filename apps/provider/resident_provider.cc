#include "apps/provider/resident_provider.h"

#include "kvshare/share/provider_share.h"

#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>

#include "kvshare/region/populate.h"
#include "kvshare/stop_signals.h"
#include "layout/state_format.h"
#include "layout/tensor_type.h"

namespace kvshare::refmodel {
namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// How often a channel waiting for serve's next request asks whether to stop.
constexpr int kStopPollMs = 100;

// A resident request's ids and bounds are its fields (provider_protocol.h).
const IdsSource kRequestSource{"field \"tokens\"",     "n_cached",         "kv.n_ctx", "field \"stream\"",
                               "field \"first_cell\"", "field \"n_cells\""};

void log_error(const Error& error) { fmt::print(stderr, "kvshare-prefill: {}\n", error.what()); }

int exit_failed(const Error& error) {
  log_error(error);
  return 1;
}

ProviderReply failed(ProviderOp op, const Error& error) {
  ProviderReply reply;
  reply.op = op;
  reply.ok = false;
  // The protocol's "errno" is 1..4095; a failure the OS had no part in (a mismatched
  // header, a bad field) is the request's fault: EINVAL.
  reply.error_errno = error.errno_value() != 0 ? error.errno_value() : EINVAL;
  reply.error = error.message();
  return reply;
}

// Waits until a frame (or serve's close) is readable, asking `stop_requested` every
// kStopPollMs. Polls the socket itself rather than giving ProviderChannel::next a timeout:
// that timeout could expire in the middle of a frame, and the channel is unusable after it.
Result<bool> wait_for_request(const ProviderChannel& channel, const std::function<bool()>& stop_requested) {
  for (;;) {
    if (stop_requested()) return false;
    pollfd ready{channel.fd(), POLLIN, 0};
    const int polled = ::poll(&ready, 1, kStopPollMs);
    if (polled > 0) return true;
    if (polled < 0 && errno != EINTR) return fail(errno, "waiting for a request on channel fd {}", channel.fd());
  }
}

// The decoder's region as serve forwarded it, checked against our model, mapped writable
// and faulted in.
struct MappedRegion {
  ProviderShare share;
  PopulateMethod method = PopulateMethod::madvise_populate_write;
};

// Takes `share`'s fds; they are closed on every failure. `peer` names the region in errors.
Result<MappedRegion> map_forwarded_region(const ProviderModel& model, ReceivedShare& share, const std::string& peer) {
  auto ours = provider_share_header(model, share.header.params);
  if (!ours) return fail(ours.error());
  auto opened = ProviderShare::open_received(std::move(share), &*ours, peer);
  if (!opened) return fail(opened.error());
  PopulateMethod method = PopulateMethod::madvise_populate_write;
  for (const auto& region : opened->imported().regions()) {
    auto populated = populate_for_write(region.mapping.bytes(), fmt::format("{}, chunk {}", peer, region.chunk));
    if (!populated) return fail(populated.error());
    if (*populated == PopulateMethod::touch_read) method = PopulateMethod::touch_read;
  }
  return MappedRegion{std::move(*opened), method};
}

}  // namespace

Result<ChannelEnd> ResidentProvider::serve(ProviderChannel& channel, const std::function<bool()>& stop_requested) {
  // The region is this channel's: whoever connects next sends its own.
  struct DropRegion {
    std::optional<HeldRegion>& region;
    ~DropRegion() { region.reset(); }
  } drop{region_};
  const std::string who = fmt::format("kvshare-serve (pid {})", channel.peer().pid);
  ProviderReply hello;
  hello.op = ProviderOp::hello;
  hello.pid = static_cast<uint64_t>(::getpid());
  hello.takes_shared = hello.takes_file = hello.takes_cached = true;
  if (auto said = channel.say_hello(hello); !said)
    return fail(said.error().with_context(fmt::format("hello to {}", who)));
  for (;;) {
    if (stop_requested) {
      auto ready = wait_for_request(channel, stop_requested);
      if (!ready) return fail(ready.error());
      if (!*ready) return ChannelEnd::stopped;
    }
    auto call = channel.next();
    if (!call) {
      if (call.error().errno_value() == ENODATA) return ChannelEnd::closed;
      return fail(call.error());
    }
    const ProviderReply reply =
        call->request.op == ProviderOp::region ? map_region(*call, who) : prefill(call->request);
    // A refused region's fds are closed before serve hears of the refusal.
    call->region.reset();
    if (auto sent = channel.reply(reply); !sent) return fail(sent.error());
  }
}

ProviderReply ResidentProvider::map_region(ProviderCall& call, const std::string& who) {
  const uint64_t region_id = call.request.region_id;
  // Unmap the old region first: the decoder behind the new one may be a restarted one with
  // a larger cache, and both mapped at once would count twice against our memory.
  region_.reset();
  const auto t0 = Clock::now();
  const std::string peer = fmt::format("region {} from {}", region_id, who);
  auto imported = call.region ? map_forwarded_region(model_, *call.region, peer)
                              : Result<MappedRegion>(fail(EPROTO, "{}: the request carried no share", peer));
  if (!imported) {
    log_error(imported.error());
    return failed(ProviderOp::region, imported.error());
  }
  uint64_t n_bytes = 0;
  for (const auto& chunk : imported->share.header().layout.chunks) n_bytes += chunk.size_bytes;
  const size_t n_chunks = imported->share.header().layout.chunks.size();
  const PopulateMethod method = imported->method;
  region_ = HeldRegion{region_id, std::move(imported->share)};
  ProviderReply reply;
  reply.op = ProviderOp::region;
  reply.region_id = region_id;
  reply.region_ms = ms_since(t0);
  fmt::print(stderr, "kvshare-prefill: region {}: {} chunk(s), {} bytes mapped and faulted in ({}) in {:.3f} ms\n",
             region_id, n_chunks, n_bytes, populate_method_name(method), reply.region_ms);
  return reply;
}

ProviderReply ResidentProvider::prefill(const ProviderRequest& request) {
  const std::string_view route = prefill_route_name(request.route);
  auto report = request.route == PrefillRoute::shared ? prefill_shared(request) : prefill_file(request);
  if (!report) {
    const Error error = report.error().with_context(fmt::format("{} route", route));
    log_error(error);
    return failed(ProviderOp::prefill, error);
  }
  fmt::print(stderr, "kvshare-prefill: {} route, {} tokens ({} prefilled): forward {:.3f} ms, write {:.3f} ms\n",
             report->route, report->n_tokens, report->n_prefilled, report->forward_ms, report->write_ms);
  ProviderReply reply;
  reply.op = ProviderOp::prefill;
  reply.prefill_ms = report->prefill_ms;
  reply.n_prefilled = report->n_prefilled;
  return reply;
}

Result<PrefillReport> ResidentProvider::prefill_shared(const ProviderRequest& request) {
  // ESTALE tells serve to send the region again and ask once more (provider_protocol.h).
  if (!region_) return fail(ESTALE, "no region is held (send region {} first)", request.region_id);
  if (region_->region_id != request.region_id)
    return fail(ESTALE, "region {} is not the one held ({}); send it again", request.region_id, region_->region_id);
  // No chunk files: our mapping was faulted in when the region came, so writing through it
  // is the fast way now (kvshare/region/chunk_file.h: a warm mapping beats pwrite()).
  const RegionTarget target{region_->share.header(), region_->share.imported(), {},
                            request.stream,          request.first_cell,        request.n_cells};
  return prefill_region(model_, target, request.tokens, request.n_cached, n_threads_, kRequestSource, own_);
}

Result<PrefillReport> ResidentProvider::prefill_file(const ProviderRequest& request) {
  auto type_k = layout::parse_cache_type(request.kv.type_k);
  if (!type_k) return fail(type_k.error().with_context("field \"kv.type_k\""));
  auto type_v = layout::parse_cache_type(request.kv.type_v);
  if (!type_v) return fail(type_v.error().with_context("field \"kv.type_v\""));
  uint32_t version = request.state_version;
  if (version == 0) version = layout::kStateSeqVersionLatest;
  if (!layout::is_known_state_version(version))
    return fail(EINVAL, "field \"state_version\" is {}: this provider writes 2 or 3 (0: the latest, 3)", version);
  StateFileTarget target;
  target.path = request.state_file;
  target.params.n_ctx = request.kv.n_ctx;
  target.params.type_k = *type_k;
  target.params.type_v = *type_v;
  target.params.flash_attn = request.kv.flash_attn;
  target.params.n_seq_max = request.kv.n_seq_max;
  target.params.kv_unified = request.kv.kv_unified;
  target.state_version = version;
  return prefill_state_file(model_, target, request.tokens, n_threads_, kRequestSource, own_);
}

int run_resident_provider(const ResidentOptions& options) {
  const bool on_fd = options.serve_fd >= 0;
  if (on_fd == !options.socket_path.empty()) {
    return exit_failed(Error(EINVAL, "give one of --serve PATH (listen) and --serve-fd N (serve's socket pair)"));
  }
  // The channel or the listener before the model: a wrong fd or path is reported at once,
  // not after a load of seconds.
  std::optional<ProviderChannel> channel;
  std::optional<ProviderListener> listener;
  if (on_fd) {
    auto made = ProviderChannel::from_fd(Fd(options.serve_fd));
    if (!made) return exit_failed(made.error());
    channel.emplace(std::move(*made));
  } else {
    auto made = ProviderListener::listen(options.socket_path);
    if (!made) return exit_failed(made.error());
    listener.emplace(std::move(*made));
  }
  install_stop_signals();
  signal(SIGPIPE, SIG_IGN);  // a serve gone mid-reply is EPIPE on that channel, not our end
  const auto stop_requested = [] { return wait_stop_signal(std::chrono::milliseconds(0)) != 0; };

  const auto t0 = Clock::now();
  auto model = load_provider_model(options.model_path);
  if (!model) return exit_failed(model.error());
  fmt::print(
      stderr, "kvshare-prefill: model {} loaded in {:.0f} ms; serving {}\n", options.model_path, ms_since(t0),
      on_fd ? fmt::format("--serve-fd {}", options.serve_fd) : fmt::format("at {}", options.socket_path.string()));
  ResidentProvider provider(std::move(*model), options.n_threads);

  if (on_fd) {
    auto ended = provider.serve(*channel, stop_requested);
    if (!ended) return exit_failed(ended.error());
    fmt::print(stderr, "kvshare-prefill: {}\n",
               *ended == ChannelEnd::closed ? "serve closed the channel: exiting" : "stop signal: exiting");
    return 0;
  }
  for (;;) {
    if (stop_requested()) break;
    auto accepted = listener->accept(kStopPollMs);
    if (!accepted) {
      const int e = accepted.error().errno_value();
      if (e == ETIMEDOUT) continue;
      log_error(accepted.error());
      if (e == EPERM || e == ECONNABORTED) continue;  // that peer is refused; the next may be serve
      return 1;
    }
    fmt::print(stderr, "kvshare-prefill: {} connected\n", fmt::format("kvshare-serve (pid {})", accepted->peer().pid));
    auto ended = provider.serve(*accepted, stop_requested);
    if (!ended) {
      // One serve's broken channel is that serve's: the next one that connects gets a
      // provider with its model still loaded.
      log_error(ended.error());
      fmt::print(stderr, "kvshare-prefill: channel dropped; waiting for the next serve at {}\n",
                 options.socket_path.string());
      continue;
    }
    if (*ended == ChannelEnd::stopped) break;
    fmt::print(stderr, "kvshare-prefill: serve closed the channel; waiting for the next at {}\n",
               options.socket_path.string());
  }
  fmt::print(stderr, "kvshare-prefill: stop signal: exiting\n");
  return 0;
}

}  // namespace kvshare::refmodel
