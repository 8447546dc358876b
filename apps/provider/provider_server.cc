#include "apps/provider/provider_server.h"

#include <fmt/format.h>
#include <httplib.h>
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <thread>

#include "apps/provider/remote_prefill.h"
#include "apps/provider/state_prefill.h"
#include "layout/json_depth.h"
#include "route/api_key.h"

namespace kvshare::refmodel {
namespace {

using Json = nlohmann::json;
constexpr const char* kJsonType = "application/json; charset=utf-8";
constexpr int kMaxBodyDepth = 20;  // the offer's header is the deepest part

void reply(httplib::Response& res, int status, const Json& body) {
  res.status = status;
  res.set_content(body.dump(), kJsonType);
}

void reply_error(httplib::Response& res, int status, const std::string& message) {
  reply(res, status, Json{{"error", Json{{"message", message}, {"code", status}}}});
}

}  // namespace

Result<PrefillBody> parse_prefill_body(std::string_view body) {
  if (body.size() > remote::kMaxOfferBytes)
    return fail(EMSGSIZE, "prefill: body is {} bytes, the limit is {}", body.size(), remote::kMaxOfferBytes);
  if (layout::json_nesting_depth(body) > kMaxBodyDepth)
    return fail(EINVAL, "prefill: JSON nests deeper than {} levels", kMaxBodyDepth);
  const Json json = Json::parse(body, nullptr, false);
  if (json.is_discarded() || !json.is_object()) return fail(EINVAL, "prefill: body is not a JSON object");
  auto tokens = json.find("tokens");
  if (tokens == json.end() || !tokens->is_array() || tokens->empty())
    return fail(EINVAL, "prefill: \"tokens\" must be a non-empty array of token ids");
  PrefillBody out;
  out.tokens.reserve(tokens->size());
  for (size_t i = 0; i < tokens->size(); ++i) {
    const Json& t = (*tokens)[i];
    if (!t.is_number_unsigned() || t.get<uint64_t>() > static_cast<uint64_t>(INT32_MAX))
      return fail(EINVAL, "prefill: tokens[{}] is {}, not a token id", i, t.dump());
    out.tokens.push_back(static_cast<int32_t>(t.get<uint64_t>()));
  }
  auto share = json.find("share");
  if (share == json.end()) return fail(EINVAL, "prefill: no \"share\" (the decoder's offer)");
  auto offer = remote::parse_offer(*share, "the prefill request");
  if (!offer) return fail(offer.error());
  out.offer = std::move(*offer);
  return out;
}

bool PrefillSlots::acquire() {
  std::unique_lock lock(mutex_);
  if (prefilling_ < parallel_ && waiting_ == 0) {
    ++prefilling_;
    return true;
  }
  if (waiting_ >= queue_) return false;
  const uint64_t ticket = next_ticket_++;
  ++waiting_;
  turn_.wait(lock, [&] { return ticket == serving_ && prefilling_ < parallel_; });
  --waiting_;
  ++serving_;
  ++prefilling_;
  turn_.notify_all();  // the next in line may fit too
  return true;
}

void PrefillSlots::release() {
  std::lock_guard lock(mutex_);
  --prefilling_;
  turn_.notify_all();
}

int PrefillSlots::prefilling() const {
  std::lock_guard lock(mutex_);
  return prefilling_;
}

int PrefillSlots::waiting() const {
  std::lock_guard lock(mutex_);
  return waiting_;
}

std::string PrefillSlots::busy_message() const {
  std::lock_guard lock(mutex_);
  return fmt::format("the provider server is busy: {} prefilling, {} waiting (--queue {})", prefilling_, waiting_,
                     queue_);
}

Result<std::vector<std::string>> resolve_provider_keys(const ProviderKeySources& sources) {
  std::vector<std::string> keys = route::parse_api_key_list(sources.api_key);
  if (!sources.api_key_file.empty()) {
    auto from_file = route::read_api_key_file(sources.api_key_file);
    if (!from_file) return fail(from_file.error());
    if (from_file->empty())
      return fail(EINVAL, "--api-key-file {}: no key in it (one key per line, \"#\" lines are comments)",
                  sources.api_key_file);
    keys.insert(keys.end(), from_file->begin(), from_file->end());
  }
  if (sources.env_key != nullptr) {
    if (*sources.env_key == '\0') return fail(EINVAL, "{} is set but empty", kRemoteKeyEnv);
    keys.emplace_back(sources.env_key);
  }
  if (sources.no_api_key) {
    if (!keys.empty())
      return fail(EINVAL, "--no-api-key, yet a key is given (--api-key, --api-key-file or {}): choose one",
                  kRemoteKeyEnv);
    return keys;
  }
  if (keys.empty())
    return fail(EINVAL,
                "no API key: give the deployment's key with --api-key-file FILE, the environment variable {} "
                "or --api-key KEY (visible to local users in /proc), or serve without one with --no-api-key",
                kRemoteKeyEnv);
  return keys;
}

int run_provider_server(const ProviderServerOptions& options) {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  ::signal(SIGPIPE, SIG_IGN);

  auto prefiller = RemotePrefiller::load(options.model_path, options.n_threads);
  if (!prefiller) {
    std::fprintf(stderr, "kvshare-provider-server: %s\n", prefiller.error().what().c_str());
    return 1;
  }
  PrefillSlots slots(options.parallel, options.queue);
  httplib::Server http;
  // A thread for every request that may prefill or wait, and a few more so /health and the
  // 503 answers never wait behind them (httplib's default pool is max(8, cores - 1)).
  const size_t n_http_threads = static_cast<size_t>(options.parallel) + static_cast<size_t>(options.queue) + 8;
  http.new_task_queue = [n_http_threads] { return new httplib::ThreadPool(n_http_threads); };
  http.set_default_headers({{"Server", "kvshare-provider-server"}});
  // Before routing, so a refused request's body is never read or parsed.
  http.set_pre_routing_handler([&options](const httplib::Request& req, httplib::Response& res) {
    if (route::is_public_endpoint(req.path) ||
        route::api_key_accepted(options.api_keys, req.get_header_value("Authorization"),
                                req.get_header_value("X-Api-Key")))
      return httplib::Server::HandlerResponse::Unhandled;
    res.status = 401;
    res.set_content(std::string(route::kInvalidApiKeyBody), kJsonType);
    std::fprintf(stderr, "kvshare-provider-server: unauthorized: Invalid API Key (%s %s from %s)\n", req.method.c_str(),
                 req.path.c_str(), req.remote_addr.c_str());
    return httplib::Server::HandlerResponse::Handled;
  });
  http.Get("/health", [&slots](const httplib::Request&, httplib::Response& res) {
    const nlohmann::ordered_json body{
        {"status", "ok"}, {"prefilling", slots.prefilling()}, {"waiting", slots.waiting()}};
    res.status = 200;
    res.set_content(body.dump(), kJsonType);
  });
  http.Post("/prefill", [&](const httplib::Request& req, httplib::Response& res) {
    auto body = parse_prefill_body(req.body);
    if (!body) {
      std::fprintf(stderr, "kvshare-provider-server: refused: %s\n", body.error().what().c_str());
      return reply_error(res, 400, body.error().what());
    }
    if (!slots.acquire()) {
      const std::string busy = slots.busy_message();
      std::fprintf(stderr, "kvshare-provider-server: share %llu: 503: %s\n",
                   static_cast<unsigned long long>(body->offer.share_id), busy.c_str());
      return reply(res, 503, Json{{"error", Json{{"code", 503}, {"message", busy}, {"type", "unavailable_error"}}}});
    }
    struct Release {
      PrefillSlots& slots;
      ~Release() { slots.release(); }
    } release{slots};
    auto report =
        options.provider_command.empty()
            ? (*prefiller)->run(body->tokens, body->offer)
            : (*prefiller)
                  ->run_command(body->tokens, body->offer, options.provider_command,
                                std::chrono::milliseconds(static_cast<int64_t>(options.provider_timeout_s * 1000)));
    if (!report) {
      // Refusals before any byte moved (EINVAL) are the request's fault; the rest the transfer's.
      const int status = report.error().errno_value() == EINVAL ? 400 : 502;
      std::fprintf(stderr, "kvshare-provider-server: share %llu: %s\n",
                   static_cast<unsigned long long>(body->offer.share_id), report.error().what().c_str());
      return reply_error(res, status, report.error().what());
    }
    std::fprintf(stderr,
                 "kvshare-provider-server: share %llu: %u tokens, %u sent (stream %u, cells %u..%u), prefill %.3f "
                 "ms (forward %.3f, transfer %.3f), %llu bytes sent\n",
                 static_cast<unsigned long long>(body->offer.share_id), report->n_tokens, report->n_sent,
                 body->offer.stream, body->offer.first_cell + body->offer.n_cached,
                 body->offer.first_cell + report->n_tokens - 1, report->prefill_ms, report->forward_ms,
                 report->transfer_ms, static_cast<unsigned long long>(report->bytes_sent));
    reply(res, 200,
          Json{{"n_tokens", report->n_tokens},
               {"n_sent", report->n_sent},
               {"prefill_ms", report->prefill_ms},
               {"forward_ms", report->forward_ms},
               {"transfer_ms", report->transfer_ms},
               {"bytes_sent", report->bytes_sent}});
  });
  StatePrefiller state_prefiller((*prefiller)->model(), options.model_path, options.n_threads);
  http.Post("/prefill-state", [&](const httplib::Request& req, httplib::Response& res) {
    // The same slots as /prefill: the CPU (or the NPU) is one resource.
    if (!slots.acquire()) {
      const std::string busy = slots.busy_message();
      std::fprintf(stderr, "kvshare-provider-server: prefill-state: 503: %s\n", busy.c_str());
      return reply(res, 503, Json{{"error", Json{{"code", 503}, {"message", busy}, {"type", "unavailable_error"}}}});
    }
    struct Release {
      PrefillSlots& slots;
      ~Release() { slots.release(); }
    } release{slots};
    const StatePrefillAnswer answer =
        state_prefiller.answer(req.body, options.provider_command,
                               std::chrono::milliseconds(static_cast<int64_t>(options.provider_timeout_s * 1000)));
    res.status = answer.status;
    if (answer.status == 200)
      res.set_header(layout::kRemoteStatePrefillMsHeader, fmt::format("{:.3f}", answer.prefill_ms));
    res.set_content(answer.body, answer.content_type);
  });
  int port = options.port;
  if (port == 0) {
    port = http.bind_to_any_port(options.host);
    if (port < 0) {
      std::fprintf(stderr, "kvshare-provider-server: cannot bind an HTTP socket on %s\n", options.host.c_str());
      return 1;
    }
  } else if (!http.bind_to_port(options.host, port)) {
    std::fprintf(stderr, "kvshare-provider-server: cannot bind %s:%d (in use, or not an address of this host)\n",
                 options.host.c_str(), port);
    return 1;
  }
  std::fprintf(stderr,
               "kvshare-provider-server: listening on http://%s:%d (model %s, prefill by %s, %d at once, %d "
               "waiting at most)\n",
               options.host.c_str(), port, options.model_path.c_str(),
               options.provider_command.empty() ? "the reference model" : options.provider_command.c_str(),
               options.parallel, options.queue);
  if (options.api_keys.empty())
    std::fprintf(stderr,
                 "kvshare-provider-server: warning: --no-api-key: anyone who reaches this port can make it "
                 "prefill and push KV rows into any decoder whose offer they send\n");
  std::atomic<bool> listen_done{false};
  std::thread listener([&] {
    http.listen_after_bind();
    listen_done = true;
  });
  while (!listen_done.load()) {
    timespec timeout{0, 200 * 1000 * 1000};
    const int sig = sigtimedwait(&signals, nullptr, &timeout);
    if (sig == SIGINT || sig == SIGTERM) break;
  }
  while (!listen_done.load()) {
    http.stop();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  listener.join();
  return 0;
}

}  // namespace kvshare::refmodel
