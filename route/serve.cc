#include "route/serve.h"

#include <httplib.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <mutex>
#include <thread>

#include "kvshare/env.h"
#include "kvshare/stop_signals.h"
#include "route/api_key.h"
#include "route/decoder_client.h"
#include "route/decoder_process.h"
#include "route/handoff.h"
#include "route/listen_socket.h"
#include "route/metrics.h"
#include "route/remote_receiver_process.h"
#include "route/remote_state.h"
#include "route/reply_timings_scanner.h"
#include "route/resident_provider.h"
#include "route/slot_queue.h"
#include "route/state_version_probe.h"
#include "route/upstream_stream.h"

namespace kvshare::route {
namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

// Threads serving requests: 32 concurrent clients each get a thread (waiting for the slot
// in arrival order) instead of waiting in the accept queue.
constexpr size_t kServerThreads = 64;

std::mutex g_stderr_mutex;
void log_line(const std::string& line) {
  std::lock_guard lock(g_stderr_mutex);
  std::fputs((line + "\n").c_str(), stderr);
  std::fflush(stderr);
}

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

void error_reply(httplib::Response& res, int status, const std::string& type, const std::string& message) {
  res.status = status;
  const Json body = {{"error", {{"code", status}, {"message", message}, {"type", type}}}};
  res.set_content(body.dump(), "application/json");
}

// Everything one forwarded request carries from its handoff to its last relayed byte.
struct RelayState {
  std::shared_ptr<UpstreamStream> stream;
  std::shared_ptr<SlotQueue::Hold> hold;
  SlotQueue::Decode decode;
  HandoffReport report;
  bool is_hybrid = false;   // a handoff was attempted (the route's lines apply)
  Clock::time_point start;  // the start of the handoff
  std::optional<ReplyTimingsScanner> scanner;
  bool first_relayed = false;
  bool finished = false;
  std::string cut_by;  // who ended the relay early: "client" or "decoder"
  Metrics* metrics = nullptr;
  const HandoffContext* context = nullptr;  // hybrid requests: the rates and the slot record to update
};

void on_first_relayed(RelayState& state) {
  if (state.first_relayed) return;
  state.first_relayed = true;
  if (!state.is_hybrid) return;
  const double first_byte_ms = ms_since(state.start);
  if (state.report.handed_off()) {
    log_line(hybrid_line(state.report, first_byte_ms));
    log_line(phases_line(state.report, first_byte_ms));
    const std::string route = state.report.route == HandoffRoute::shared         ? "shared"
                              : state.report.route == HandoffRoute::remote       ? "remote"
                              : state.report.route == HandoffRoute::remote_state ? "remote_state"
                                                                                 : "file";
    state.metrics->observe(route, state.report.prefill_ms, state.report.handoff_ms, first_byte_ms);
  } else if (state.report.decided_forward) {
    log_line(forwarded_line(state.report, first_byte_ms));
  } else {
    log_line(fmt::format(
        "hybrid: {} prompt tokens{}: forwarded as it came, first byte {:.3f} ms", state.report.n_prompt_tokens,
        state.report.n_slots > 1 ? fmt::format(", slot {}", state.report.slot) : std::string(), first_byte_ms));
  }
}

void on_relay_end(RelayState& state) {
  if (state.finished) return;
  state.finished = true;
  on_first_relayed(state);
  // With several slots a request holds its slot until its reply ends (slot_queue.h).
  if (state.hold) state.hold->release();
  if (!state.is_hybrid || !state.scanner) return;
  const ReplyTimings timings = state.scanner->finish();
  // What the decoder generated stays in its slot after the prompt: the next turn's estimate.
  if (timings.predicted_n)
    state.context->slot_record(state.report.slot).remember_generated(state.report.slot_prompt_id, *timings.predicted_n);
  // The streams' pace, for the load rule's words.
  if (timings.predicted_n && timings.predicted_ms)
    state.context->rates.observe_decode(*timings.predicted_n, *timings.predicted_ms);
  if (!state.report.handed_off()) {
    // A forward is the decoder's own prompt speed over what its slot did not hold.
    if (timings.prompt_n && timings.prompt_ms)
      state.context->rates.observe_decoder(state.report.n_prompt_tokens, *timings.prompt_n, *timings.prompt_ms);
    return;
  }
  state.context->rates.observe_handoff(state.report.handoff_ms);
  if (timings.prompt_n && *timings.prompt_n != 1) {
    state.metrics->count_prompt_not_reused();
    log_line(
        fmt::format("hybrid: warning: the decoder evaluated {} prompt tokens, not 1: the handoff was not "
                    "reused (timings.prompt_n)",
                    *timings.prompt_n));
  }
}

class Server {
 public:
  Server(const ServeConfig& config, const Backend& backend, const ServeRuntime& runtime)
      : config_(config), backend_(backend), runtime_(runtime), slot_(config.parallel) {}

  int run();

 private:
  // The key serve's own calls to the decoder carry (the decoder has the same list).
  std::string decoder_api_key() const { return config_.api_keys.empty() ? std::string() : config_.api_keys.front(); }
  bool hybrid_active() const {
    return config_.device == Device::hybrid && (has_local_provider(config_) || !config_.prefill_remote.empty());
  }
  void relay_get(const std::string& path, httplib::Response& res);
  void handle_completion(Endpoint endpoint, const httplib::Request& req, httplib::Response& res);
  void forward(const std::string& path, std::shared_ptr<RelayState> state, httplib::Response& res);

  const ServeConfig& config_;
  const Backend& backend_;
  const ServeRuntime& runtime_;
  std::unique_ptr<DecoderProcess> decoder_;
  std::unique_ptr<DecoderClient> client_;
  std::unique_ptr<RemoteReceiverProcess> remote_receiver_;  // --prefill-remote only
  std::unique_ptr<ResidentProvider> resident_provider_;     // --provider-resident, --prefill-provider-socket
  httplib::Server http_;
  SlotQueue slot_;
  Metrics metrics_;
  HandoffContext context_;
  std::atomic<bool> decoder_died_{false};
};

void Server::relay_get(const std::string& path, httplib::Response& res) {
  auto reply = client_->get(path);
  if (!reply) return error_reply(res, 503, "unavailable_error", reply.error().what());
  res.status = reply->status;
  res.set_content(reply->body, reply->content_type.empty() ? "application/json" : reply->content_type);
}

void Server::forward(const std::string& path, std::shared_ptr<RelayState> state, httplib::Response& res) {
  UpstreamStream::Request request;
  request.host = "127.0.0.1";
  request.port = decoder_->port();
  request.method = "POST";
  request.path = path;
  request.body = state->report.body;
  request.api_key = decoder_api_key();
  // With one slot, the slot is free for the next handoff as soon as the decoder has started
  // on this one (the decoder queues the next request's restore or adopt behind this reply,
  // while its provider already runs); with several, at the reply's end (on_relay_end).
  std::function<void()> on_head;
  if (slot_.n_slots() == 1) on_head = [hold = state->hold] { hold->release(); };
  state->stream = UpstreamStream::start(std::move(request), std::move(on_head));
  auto head = state->stream->wait_head();
  if (!head) {
    state->hold->release();
    log_line(fmt::format("kvshare-serve: {}", head.error().what()));
    on_relay_end(*state);
    return error_reply(res, 502, "server_error", head.error().what());
  }
  const std::string content_type = head->content_type.empty() ? "application/json" : head->content_type;
  state->scanner.emplace(content_type.find("text/event-stream") != std::string::npos);
  res.status = head->status;
  res.set_chunked_content_provider(
      content_type,
      [state](size_t, httplib::DataSink& sink) {
        std::string piece;
        if (state->stream->next(piece)) {
          on_first_relayed(*state);
          state->scanner->feed(piece);
          if (sink.write(piece.data(), piece.size())) return true;
          state->cut_by = "client";
          return false;
        }
        if (auto cut = state->stream->transport_error()) {
          state->cut_by = "decoder";
          log_line(fmt::format("kvshare-serve: {}", cut->what()));
          on_relay_end(*state);
          return false;  // the client sees the reply cut, as it was
        }
        on_relay_end(*state);
        sink.done();
        return true;
      },
      [state](bool complete) {
        state->stream->cancel();
        // httplib also ends a relay unfinished when it finds the client's socket closed
        // before asking for the next piece.
        if (!complete) state->metrics->count_reply_cut(state->cut_by.empty() ? "client" : state->cut_by);
        on_relay_end(*state);
      });
}

void Server::handle_completion(Endpoint endpoint, const httplib::Request& req, httplib::Response& res) {
  metrics_.count_request(std::string(endpoint_path(endpoint)));
  auto state = std::make_shared<RelayState>();
  state->metrics = &metrics_;
  state->report.body = req.body;
  if (!hybrid_active()) {
    state->hold = std::make_shared<SlotQueue::Hold>();
    state->decode = slot_.begin_decode();
    return forward(std::string(endpoint_path(endpoint)), state, res);
  }
  state->is_hybrid = true;
  state->context = &context_;
  state->start = Clock::now();
  state->report = run_handoff(context_, endpoint, req.body, [this, &state](std::span<const int32_t> ids) {
    // The free slot whose cells likely hold most of this prompt (a chat's next turn).
    state->hold = std::make_shared<SlotQueue::Hold>(slot_.acquire(
        [this, ids](int slot) { return ids.empty() ? size_t{0} : context_.slot_record(slot).estimate_cached(ids); }));
    return state->hold->slot();
  });
  state->decode = slot_.begin_decode(state->report.slot);
  forward(std::string(endpoint_path(endpoint)), state, res);
}

int Server::run() {
  // SIGINT/SIGTERM go to the signal thread below (kvshare/stop_signals.h).
  install_stop_signals();
  ::signal(SIGPIPE, SIG_IGN);

  if (config_.device == Device::hybrid && !hybrid_active())
    log_line(
        "kvshare-serve: --device hybrid without a prefill provider (--prefill-provider or "
        "ONEBIT_HYBRID_PREFILL): every prompt is prefilled by the decoder itself, one slot, plain relay");

  auto decoder =
      DecoderProcess::start(config_, backend_, runtime_.decoder_ready_timeout, [this](const ExitStatus& status) {
        decoder_died_ = true;
        log_line(fmt::format("kvshare-serve: the decoder exited ({}); it is not restarted, kvshare-serve exits",
                             status.describe()));
        http_.stop();
      });
  if (!decoder) {
    log_line(fmt::format("kvshare-serve: {}", decoder.error().what()));
    return 1;
  }
  decoder_ = std::move(*decoder);
  client_ = std::make_unique<DecoderClient>("127.0.0.1", decoder_->port(), std::chrono::milliseconds(600000),
                                            decoder_api_key());

  context_.config = &config_;
  context_.decoder = client_.get();
  context_.slot_dir = decoder_->slot_dir();
  context_.slot = &slot_;
  context_.slot_records.resize(static_cast<size_t>(slot_.n_slots()));
  context_.tokenize_gate = std::make_unique<std::counting_semaphore<kMaxSlots>>(slot_.n_slots());
  context_.metrics = &metrics_;
  context_.log = log_line;
  context_.handshake_timeout = runtime_.handshake_timeout;
  if (hybrid_active() && !config_.prefill_remote.empty()) {
    // A decoder that does not speak the share action (a stock llama-server) takes the state
    // variant: the provider server answers a bound state file, restored here.
    bool shares = backend_.kind == BackendKind::kvshare_decoder;
    if (!shares && config_.prefill_remote_route == RemoteRouteKind::automatic) {
      auto speaks = decoder_speaks_share(*client_);
      if (!speaks)
        log_line(
            fmt::format("kvshare-serve: could not ask the decoder whether it shares ({}); the remote route "
                        "takes the state variant",
                        speaks.error().what()));
      shares = speaks.value_or(false);
    }
    context_.remote_state = resolve_remote_route(config_.prefill_remote_route, shares) == RemoteRouteKind::state;
    if (context_.remote_state)
      log_line(fmt::format(
          "kvshare-serve: remote route by state file ({}): {} answers POST /prefill-state with a state file bound "
          "to the model, the tokenizer and the state version, and the decoder restores it",
          config_.prefill_remote_route == RemoteRouteKind::state ? "--prefill-remote-route state"
                                                                 : "the decoder does not speak ?action=share",
          fmt::join(config_.prefill_remote, ", ")));
    // validate() parsed every URL already.
    context_.prefill_hosts =
        std::make_unique<PrefillHosts>(std::move(*PrefillHosts::from_urls(config_.prefill_remote)));
  }
  if (hybrid_active() && !config_.prefill_remote.empty() && !context_.remote_state) {
    // Started now, so the first request does not pay for it; a start that fails is the
    // first request's fallback (and the next one's retry), never serve's exit.
    RemoteReceiverProcess::Options receiver_options;
    receiver_options.program = runtime_.serve_dir / "kvshare-remote-receiver";
    receiver_options.private_dir = decoder_->slot_dir();
    receiver_options.log = log_line;
    receiver_options.metrics = &metrics_;
    remote_receiver_ = std::make_unique<RemoteReceiverProcess>(std::move(receiver_options));
    if (auto up = remote_receiver_->ensure_running(); up)
      log_line(fmt::format("kvshare-serve: remote receiver running (pid {})", remote_receiver_->pid()));
    else
      log_line(fmt::format("kvshare-serve: {}", up.error().what()));
    context_.remote_receiver = remote_receiver_.get();
  }
  if (hybrid_active() && provider_is_resident(config_)) {
    // Started now, as the receiver is: the model load is not the first request's. A start
    // that fails is the first request's fallback and the next one's retry.
    ResidentProvider::Options provider_options;
    if (config_.provider_resident)
      provider_options.argv =
          resident_provider_command(config_.prefill_provider, config_.model.string(), config_.elfs_dir);
    provider_options.socket_path = config_.prefill_provider_socket;
    provider_options.log = log_line;
    provider_options.metrics = &metrics_;
    provider_options.hello_timeout = std::max(provider_timeout(config_), std::chrono::milliseconds(1000));
    resident_provider_ = std::make_unique<ResidentProvider>(std::move(provider_options));
    if (auto up = resident_provider_->ensure_running(); up)
      log_line(fmt::format("kvshare-serve: resident provider running (pid {}{})", resident_provider_->pid(),
                           config_.prefill_provider_socket.empty() ? "" : ", at " + config_.prefill_provider_socket));
    else
      log_line(fmt::format("kvshare-serve: {}", up.error().what()));
    context_.resident_provider = resident_provider_.get();
  }
  if (hybrid_active()) {
    // What fits a slot is the decoder's to say: llama-server caps -c / -np at the model's
    // training context (and -kvu gives every slot the whole -c). Every "does it fit" uses it.
    const size_t assumed = static_cast<size_t>(config_.ctx_size / slot_.n_slots());
    if (auto n_ctx = client_->slot_context(); n_ctx) {
      context_.slot_ctx_size = *n_ctx;
      if (*n_ctx != assumed)
        log_line(
            fmt::format("kvshare-serve: each decoder slot holds {} cells, not the {} of -c {} / -np {} (GET /props): a "
                        "longer prompt goes to the decoder as it came",
                        *n_ctx, assumed, config_.ctx_size, slot_.n_slots()));
    } else {
      log_line(
          fmt::format("kvshare-serve: could not learn the decoder's slot context ({}); serve assumes -c / -np, "
                      "{} cells",
                      n_ctx.error().what(), assumed));
    }
    auto version = probe_decoder_state_version(*client_, decoder_->slot_dir());
    if (version) {
      context_.decoder_state_version = *version;
      log_line(
          fmt::format("kvshare-serve: the decoder restores state files of version {} (probed with a save of "
                      "its empty slot); file-route providers get {}={}",
                      *version, kStateVersionEnv, *version));
    } else {
      log_line(
          fmt::format("kvshare-serve: could not learn the decoder's state-file version ({}); providers write "
                      "their default and the restore is the check",
                      version.error().what()));
    }
  }

  http_.new_task_queue = [] { return new httplib::ThreadPool(kServerThreads); };
  // llama-server's --api-key in front of the route: a prompt without the key must not
  // start a provider, let alone a share.
  http_.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (is_public_endpoint(req.path) ||
        api_key_accepted(config_.api_keys, req.get_header_value("Authorization"), req.get_header_value("X-Api-Key")))
      return httplib::Server::HandlerResponse::Unhandled;
    res.status = 401;
    res.set_content(std::string(kInvalidApiKeyBody), "application/json; charset=utf-8");
    return httplib::Server::HandlerResponse::Handled;
  });
  // A client that keeps its connection (OpenAI's SDKs do) would otherwise see each reply's
  // body wait for its delayed ACK of the head (kvshare-bench serve; docs/hybrid.md, "Serve's
  // own overhead").
  // And it keeps it for 100 requests, as llama-server allows (Debian's httplib: 5).
  http_.set_tcp_nodelay(true);
  http_.set_keep_alive_max_count(100);
  http_.set_read_timeout(std::chrono::seconds(600));
  http_.set_write_timeout(std::chrono::seconds(600));
  http_.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    handle_completion(Endpoint::chat_completions, req, res);
  });
  http_.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    handle_completion(Endpoint::completions, req, res);
  });
  for (const char* path : {"/health", "/v1/health", "/v1/models", "/props"})
    http_.Get(path, [this, path](const httplib::Request&, httplib::Response& res) { relay_get(path, res); });
  http_.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_.render(), "text/plain; version=0.0.4");
  });

  // cpp-httplib listens with a backlog of 5: a burst of clients overflows it and, with SYN
  // cookies, the kernel answers the overflow with resets. Keep the listening socket's fd
  // (the options hook sees it before bind) and listen again with a deep queue. SO_REUSEADDR
  // only: httplib's default SO_REUSEPORT would let a second server share the port.
  int listen_fd = -1;
  Error reuseaddr_error;
  http_.set_socket_options([&listen_fd, &reuseaddr_error](int fd) {
    if (auto set = reuse_address(fd); !set) reuseaddr_error = set.error();
    listen_fd = fd;
  });
  int port = config_.port;
  if (port == 0)
    port = http_.bind_to_any_port(config_.host);
  else if (!http_.bind_to_port(config_.host, port))
    port = -1;
  if (port <= 0) {
    log_line(fmt::format("kvshare-serve: cannot listen on {}:{} (in use, or not an address of this machine)",
                         config_.host, config_.port));
    decoder_->stop();
    return 1;
  }
  // A server that cannot take a burst of clients, or that another could bind beside, is
  // not started half-configured.
  Error listen_error;
  const std::string where = fmt::format("serve's socket for {}:{}", config_.host, port);
  if (reuseaddr_error.errno_value() != 0)
    listen_error = reuseaddr_error.with_context(where);
  else if (listen_fd < 0)
    listen_error =
        Error(EBADF, fmt::format("no listening socket for {}:{} reached the socket options hook", config_.host, port));
  else if (auto deep = deepen_backlog(listen_fd); !deep)
    listen_error = deep.error().with_context(where);
  if (listen_error.errno_value() != 0) {
    log_line(fmt::format("kvshare-serve: {}", listen_error.what()));
    decoder_->stop();
    return 1;
  }
  if (decoder_died_) {
    decoder_->stop();
    return 1;
  }
  log_line(
      fmt::format("kvshare-serve: listening on http://{}:{} (device {}, decoder {} on 127.0.0.1:{}, "
                  "provider {}, route {})",
                  config_.host, port, device_name(config_.device), backend_kind_name(backend_.kind), decoder_->port(),
                  !config_.prefill_remote.empty() ? fmt::format("{}", fmt::join(config_.prefill_remote, ", "))
                  : has_local_provider(config_)   ? provider_name(config_)
                                                  : std::string("none"),
                  !hybrid_active()                  ? "relay"
                  : context_.remote_state           ? "remote-state"
                  : !config_.prefill_remote.empty() ? "remote"
                  : config_.kv_share                ? "shared"
                                                    : "file"));

  // httplib's stop() does nothing until listen_after_bind() has started its loop, so a
  // SIGTERM (or the decoder's death) that lands just before it would be lost and serve
  // would run on: the signal thread repeats stop() until the loop has ended. (Seen under
  // ASan, where start-up is slow enough for the test's SIGTERM to hit that window.)
  std::atomic<bool> listen_ended{false};
  std::thread signal_thread([&] {
    bool signalled = false;
    while (!listen_ended) {
      const int received = wait_stop_signal(std::chrono::milliseconds(20));
      if ((received == SIGINT || received == SIGTERM) && !signalled) {
        signalled = true;
        log_line(fmt::format("kvshare-serve: {} received, stopping", received == SIGINT ? "SIGINT" : "SIGTERM"));
      }
      if (signalled || decoder_died_) http_.stop();
    }
  });
  http_.listen_after_bind();
  listen_ended = true;
  signal_thread.join();
  remote_receiver_.reset();
  resident_provider_.reset();
  decoder_->stop();
  return decoder_died_ ? 1 : 0;
}

}  // namespace

std::filesystem::path own_binary_dir() {
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::filesystem::current_path() : self.parent_path();
}

std::string print_backend_line(const ServeConfig& config, const Backend& backend) {
  std::vector<std::string> argv = backend_command(config, backend, "<private slot dir>", 0);
  for (size_t i = 0; i + 1 < argv.size(); ++i)
    if (argv[i] == "--port") {
      argv[i + 1] = "<free port>";
      break;
    }
  return join_command(argv);
}

int run_serve(const ServeConfig& config, const Backend& backend, const ServeRuntime& runtime) {
  Server server(config, backend, runtime);
  return server.run();
}

}  // namespace kvshare::route
