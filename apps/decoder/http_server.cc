#include "apps/decoder/http_server.h"

#include <fmt/format.h>
#include <httplib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <ctime>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>

#include "apps/decoder/api_error.h"
#include "apps/decoder/completion.h"
#include "apps/decoder/prompt.h"
#include "apps/decoder/responses.h"
#include "apps/decoder/slot.h"
#include "apps/decoder/slot_request.h"
#include "route/api_key.h"

namespace kvshare::decoder {
namespace {

constexpr const char* kJsonType = "application/json; charset=utf-8";

// server-common.h json_value: the default when the key is absent, null or mistyped.
template <class T>
T json_value(const Json& body, const char* key, T fallback) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return fallback;
  try {
    return it->get<T>();
  } catch (const std::exception&) {
    return fallback;
  }
}

void reply_json(httplib::Response& res, int status, const Json& body) {
  res.status = status;
  res.set_content(body.dump(-1, ' ', false, Json::error_handler_t::replace), kJsonType);
}

void reply_error(httplib::Response& res, const ApiError& error) {
  res.status = error.status(), res.set_content(error.body(), kJsonType);
}

bool is_valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    i += n;
  }
  return true;
}

}  // namespace

struct DecoderServer::Impl {
  ServerOptions options;
  httplib::Server http;
  std::atomic<SlotEngine*> engine{nullptr};
  std::unique_ptr<Slot> slot;  // one slot: the route uses one, and -np > 1 is refused
  std::atomic<bool> stopping{false};
  int port = -1;

  explicit Impl(ServerOptions o) : options(std::move(o)) {}

  using Handler = std::function<void(const httplib::Request&, httplib::Response&)>;

  // ex_wrapper: no exception leaves a handler.
  Handler guarded(Handler handler) {
    return [handler = std::move(handler)](const httplib::Request& req, httplib::Response& res) {
      try {
        handler(req, res);
      } catch (const std::invalid_argument& e) {
        reply_error(res, ApiError{ErrorType::invalid_request, e.what()});
      } catch (const std::exception& e) {
        reply_error(res, ApiError{ErrorType::server, e.what()});
      } catch (...) {
        reply_error(res, ApiError{ErrorType::server, "unknown error"});
      }
    };
  }

  SlotEngine& eng() { return *engine.load(); }

  void routes();
  void handle_completion(const httplib::Request& req, httplib::Response& res, ResponseFormat format);
  void handle_slots_action(const httplib::Request& req, httplib::Response& res);
  Json props();
  Json model_info();
};

void DecoderServer::Impl::routes() {
  http.set_default_headers({{"Server", "kvshare-decoder"}});
  http.set_error_handler([](const httplib::Request&, httplib::Response& res) {
    if (res.status == 404) {
      reply_json(res, 404,
                 Json{{"error", Json{{"message", "File Not Found"}, {"type", "not_found_error"}, {"code", 404}}}});
    }
  });
  http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string message = "Unknown Exception";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      message = e.what();
    } catch (...) {
    }
    res.status = 500;
    res.set_content(message, "text/plain");
  });
  // llama-server's order: 503 while loading, then the api key (server-http.cpp).
  http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (engine.load() == nullptr) {
      reply_error(res, ApiError{ErrorType::unavailable, "Loading model"});
      return httplib::Server::HandlerResponse::Handled;
    }
    if (!route::is_public_endpoint(req.path) &&
        !route::api_key_accepted(options.api_keys, req.get_header_value("Authorization"),
                                 req.get_header_value("X-Api-Key"))) {
      res.status = 401;
      res.set_content(std::string(route::kInvalidApiKeyBody), kJsonType);
      std::fprintf(stderr, "kvshare-decoder: unauthorized: Invalid API Key (%s %s)\n", req.method.c_str(),
                   req.path.c_str());
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });

  const auto health = guarded([](const httplib::Request&, httplib::Response& res) {
    reply_json(res, 200, Json{{"status", "ok"}});
  });
  http.Get("/health", health);
  http.Get("/v1/health", health);
  http.Get("/metrics", guarded([](const httplib::Request&, httplib::Response& res) {
             reply_error(res, ApiError{ErrorType::not_supported,
                                       "This server does not support metrics endpoint. Start it with `--metrics`"});
           }));
  http.Get("/props",
           guarded([this](const httplib::Request&, httplib::Response& res) { reply_json(res, 200, props()); }));
  http.Post("/props", guarded([](const httplib::Request&, httplib::Response& res) {
              reply_error(res,
                          ApiError{ErrorType::not_supported,
                                   "This server does not support changing global properties. Start it with `--props`"});
            }));
  const auto models = guarded([this](const httplib::Request&, httplib::Response& res) {
    const std::string& name = options.model_name;
    Json listing{
        {"models", Json::array({Json{
                       {"name", name},
                       {"model", name},
                       {"modified_at", ""},
                       {"size", ""},
                       {"digest", ""},
                       {"type", "model"},
                       {"description", ""},
                       {"tags", Json::array({""})},
                       {"capabilities", Json::array({"completion"})},
                       {"parameters", ""},
                       {"details", Json{{"parent_model", ""},
                                        {"format", "gguf"},
                                        {"family", ""},
                                        {"families", Json::array({""})},
                                        {"parameter_size", ""},
                                        {"quantization_level", ""}}},
                   }})},
        {"object", "list"},
        {"data", Json::array({model_info()})},
    };
    reply_json(res, 200, listing);
  });
  http.Get("/models", models);
  http.Get("/v1/models", models);

  const auto native = guarded([this](const httplib::Request& req, httplib::Response& res) {
    handle_completion(req, res, ResponseFormat::native);
  });
  http.Post("/completion", native);
  http.Post("/completions", native);
  http.Post("/v1/completions", guarded([this](const httplib::Request& req, httplib::Response& res) {
              handle_completion(req, res, ResponseFormat::oai_completion);
            }));
  const auto chat = guarded([this](const httplib::Request& req, httplib::Response& res) {
    handle_completion(req, res, ResponseFormat::oai_chat);
  });
  http.Post("/chat/completions", chat);
  http.Post("/v1/chat/completions", chat);

  http.Post("/tokenize", guarded([this](const httplib::Request& req, httplib::Response& res) {
              const Json body = Json::parse(req.body);
              Json tokens = Json::array();
              if (body.count("content") != 0) {
                const bool add_special = json_value(body, "add_special", false);
                const bool parse_special = json_value(body, "parse_special", true);
                const bool with_pieces = json_value(body, "with_pieces", false);
                auto ids = tokenize_mixed(eng(), body.at("content"), add_special, parse_special);
                if (!ids) return reply_error(res, ids.error());
                for (int32_t id : *ids) {
                  if (!with_pieces) {
                    tokens.push_back(id);
                    continue;
                  }
                  const std::string piece = eng().token_to_piece(id, true);
                  Json piece_json;
                  if (is_valid_utf8(piece)) {
                    piece_json = piece;
                  } else {
                    piece_json = Json::array();
                    for (unsigned char c : piece) piece_json.push_back(static_cast<int>(c));
                  }
                  tokens.push_back(Json{{"id", id}, {"piece", piece_json}});
                }
              }
              reply_json(res, 200, Json{{"tokens", tokens}});
            }));
  http.Post("/detokenize", guarded([this](const httplib::Request& req, httplib::Response& res) {
              const Json body = Json::parse(req.body);
              std::string content;
              if (body.count("tokens") != 0) {
                const auto ids = body.at("tokens").get<std::vector<int32_t>>();
                auto text = detokenize(eng(), ids);
                if (!text) return reply_error(res, text.error());
                content = std::move(*text);
              }
              reply_json(res, 200, Json{{"content", content}});
            }));
  http.Post("/apply-template", guarded([this](const httplib::Request& req, httplib::Response& res) {
              const Json body = Json::parse(req.body);
              auto request = chat_to_completion_request(eng(), body);
              if (!request) return reply_error(res, request.error());
              reply_json(res, 200, Json{{"prompt", request->at("prompt")}});
            }));

  http.Get("/slots", guarded([this](const httplib::Request& req, httplib::Response& res) {
             if (!options.endpoint_slots) {
               return reply_error(res,
                                  ApiError{ErrorType::not_supported,
                                           "This server does not support slots endpoint. Start it with `--slots`"});
             }
             if (!req.get_param_value("fail_on_no_slot").empty() && slot->is_processing()) {
               return reply_error(res, ApiError{ErrorType::unavailable, "no slot available"});
             }
             reply_json(res, 200, Json::array({slot->to_json()}));
           }));
  http.Post(R"(/slots/([^/]*))",
            guarded([this](const httplib::Request& req, httplib::Response& res) { handle_slots_action(req, res); }));
}

Json DecoderServer::Impl::model_info() {
  const ModelInfo& info = eng().info();
  return Json{
      {"id", options.model_name},
      {"aliases", Json::array({options.model_name})},
      {"tags", Json::array()},
      {"object", "model"},
      {"created", std::time(nullptr)},
      {"owned_by", "llamacpp"},
      {"meta", Json{{"vocab_type", info.vocab_type == "bpe" ? 2 : 0},
                    {"n_vocab", info.n_vocab},
                    {"n_ctx", eng().n_ctx()},
                    {"n_ctx_train", info.n_ctx_train},
                    {"n_embd", info.n_embd},
                    {"n_params", info.n_params},
                    {"size", info.size_bytes}}},
  };
}

Json DecoderServer::Impl::props() {
  const ModelInfo& info = eng().info();
  CompletionParams defaults;
  return Json{
      {"default_generation_settings", Json{{"params", defaults.to_json()}, {"n_ctx", eng().n_ctx()}}},
      {"total_slots", 1},
      {"model_alias", options.model_name},
      {"model_path", info.model_path},
      {"modalities", Json{{"vision", false}, {"video", false}, {"audio", false}}},
      {"endpoint_slots", options.endpoint_slots},
      {"endpoint_props", false},
      {"endpoint_metrics", false},
      {"chat_template", info.chat_template},
      {"chat_template_caps", Json::object()},
      {"bos_token", info.bos_token},
      {"eos_token", info.eos_token},
      {"build_info", build_info()},
      {"is_sleeping", false},
  };
}

void DecoderServer::Impl::handle_completion(const httplib::Request& req, httplib::Response& res,
                                            ResponseFormat format) {
  Json data = Json::parse(req.body);  // malformed JSON: 500 with the parser's text, as llama-server
  if (format == ResponseFormat::oai_chat) {
    auto parsed = chat_to_completion_request(eng(), data);
    if (!parsed) return reply_error(res, parsed.error());
    data = std::move(*parsed);
  }
  // handle_completions_impl: everything from here to the task launch is a 400 on failure.
  if (!data.is_object() || !data.contains("prompt")) {
    return reply_error(
        res, ApiError{ErrorType::invalid_request, "[json.exception.out_of_range.403] key 'prompt' not found"});
  }
  auto prompt = tokenize_completion_prompt(eng(), data.at("prompt"));
  if (!prompt) return reply_error(res, prompt.error());
  auto params = parse_completion_params(data);
  if (!params) return reply_error(res, params.error());
  if (auto valid = slot->validate_prompt(*prompt); !valid) return reply_error(res, valid.error());

  ResponseContext context{format, make_completion_id(), options.model_name, *params};
  if (!params->stream) {
    auto result = slot->complete(*prompt, *params, {}, &stopping);
    if (!result) return reply_error(res, result.error());
    return reply_json(res, 200, final_response(context, *result));
  }

  res.status = 200;
  res.set_header("X-Accel-Buffering", "no");
  auto tokens = std::make_shared<std::vector<int32_t>>(std::move(*prompt));
  res.set_chunked_content_provider("text/event-stream", [this, context, tokens](size_t, httplib::DataSink& sink) {
    const auto send = [&sink](const std::string& bytes) {
      return bytes.empty() || sink.write(bytes.data(), bytes.size());
    };
    bool client_gone = false;
    auto result = slot->complete(
        *tokens, context.params,
        [&](const PartialToken& token) {
          const Json chunk = partial_response(context, token);
          if (chunk.is_array() && chunk.empty()) return true;
          if (!send(format_sse(chunk))) client_gone = true;
          return !client_gone;
        },
        &stopping);
    if (client_gone) return false;
    if (!result) {
      // After the headers an error can only be one more event, as llama-server sends it.
      send(format_sse(Json{{"error", result.error().to_json()}}));
    } else {
      send(format_sse(final_response(context, *result)));
      if (context.format != ResponseFormat::native) send(kSseDone);
    }
    sink.done();
    return true;
  });
}

void DecoderServer::Impl::handle_slots_action(const httplib::Request& req, httplib::Response& res) {
  if (options.slot_save_path.empty()) {
    return reply_error(res, ApiError{ErrorType::not_supported,
                                     "This server does not support slots action. Start it with `--slot-save-path`"});
  }
  int id_slot = 0;
  try {
    id_slot = std::stoi(req.matches[1].str());
  } catch (const std::exception&) {
    return reply_error(res, ApiError{ErrorType::invalid_request, "Invalid slot ID"});
  }
  // get_slot_by_id: out-of-range ids wrap around (id % n_slots, in size_t arithmetic).
  const size_t n_slots = 1;
  const auto slot_index = static_cast<int>(static_cast<size_t>(id_slot) % n_slots);
  if (slot_index != slot->id()) return reply_error(res, ApiError{ErrorType::invalid_request, "Invalid slot ID"});

  const std::string action = req.get_param_value("action");
  if (action == "save" || action == "restore") {
    auto request = parse_slot_file_request(req.body);
    if (!request) return reply_error(res, request.error());
    const std::string& filename = request->filename;
    const std::filesystem::path path = options.slot_save_path / filename;
    if (action == "save") {
      auto saved = slot->save(filename, path);
      if (!saved) return reply_error(res, saved.error());
      return reply_json(res, 200,
                        Json{{"id_slot", id_slot},
                             {"filename", saved->filename},
                             {"n_saved", saved->n_tokens},
                             {"n_written", saved->n_bytes},
                             {"timings", Json{{"save_ms", saved->ms}}}});
    }
    auto restored = slot->restore(filename, path);
    if (!restored) return reply_error(res, restored.error());
    return reply_json(res, 200,
                      Json{{"id_slot", id_slot},
                           {"filename", restored->filename},
                           {"n_restored", restored->n_tokens},
                           {"n_read", restored->n_bytes},
                           {"timings", Json{{"restore_ms", restored->ms}}}});
  }
  if (action == "erase") {
    const int32_t n_erased = slot->erase();
    return reply_json(res, 200, Json{{"id_slot", id_slot}, {"n_erased", n_erased}});
  }
  if (action == "share" || action == "adopt") {
    if (eng().share_availability() != ShareAvailability::enabled) {
      return reply_error(res, ApiError{ErrorType::not_supported,
                                       eng().share_refusal() + ". Use the state-file route (?action=restore)."});
    }
    if (action == "share") {
      auto request = parse_share_request(req.body);
      if (!request) return reply_error(res, request.error());
      auto shared = slot->share(request->socket, request->tokens ? &*request->tokens : nullptr);
      if (!shared) return reply_error(res, shared.error());
      return reply_json(res, 200,
                        Json{{"id_slot", id_slot},
                             {"share_id", shared->reply.share_id},
                             {"backend", shared->reply.backend},
                             {"n_fds", shared->reply.n_fds},
                             {"region_bytes", shared->reply.region_bytes},
                             {"n_cached", shared->n_cached},
                             {"timings", Json{{"share_ms", shared->ms}}}});
    }
    auto request = parse_adopt_request(req.body);
    if (!request) return reply_error(res, request.error());
    const uint64_t share_id = request->share_id;
    const std::vector<int32_t>& tokens = request->tokens;
    auto adopted = slot->adopt(tokens, share_id, request->n_cached);
    if (!adopted) return reply_error(res, adopted.error());
    return reply_json(res, 200,
                      Json{{"id_slot", id_slot},
                           {"share_id", share_id},
                           {"n_adopted", adopted->n_adopted},
                           {"timings", Json{{"adopt_ms", adopted->ms}}}});
  }
  reply_error(res, ApiError{ErrorType::invalid_request, "Invalid action"});
}

DecoderServer::DecoderServer(ServerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  impl_->routes();
  int n_threads = impl_->options.n_threads_http;
  if (n_threads < 1) n_threads = std::max(8, static_cast<int>(std::thread::hardware_concurrency()) - 1);
  impl_->http.new_task_queue = [n_threads] { return new httplib::ThreadPool(static_cast<size_t>(n_threads)); };
  // Idle keep-alive connections hold a worker; a short timeout keeps shutdown prompt.
  impl_->http.set_keep_alive_timeout(1);
  // A reply is a head and then body pieces, written one after the other: with Nagle on, a
  // piece on a kept-alive connection waits for the client's delayed ACK of the head
  // (docs/hybrid.md, "Serve's own overhead", has what that cost).
  impl_->http.set_tcp_nodelay(true);
  impl_->http.set_keep_alive_max_count(100);  // llama-server's count (Debian's httplib: 5)
}

DecoderServer::~DecoderServer() { stop(); }

Result<void> DecoderServer::bind() {
  const ServerOptions& o = impl_->options;
  if (o.port == 0) {
    const int port = impl_->http.bind_to_any_port(o.host);
    if (port < 0) return fail(EADDRNOTAVAIL, "cannot bind an HTTP socket on {} (any port)", o.host);
    impl_->port = port;
  } else {
    if (!impl_->http.bind_to_port(o.host, o.port)) {
      return fail(EADDRINUSE, "cannot bind the HTTP socket on {}:{} (in use, or not an address of this host)", o.host,
                  o.port);
    }
    impl_->port = o.port;
  }
  return {};
}

int DecoderServer::bound_port() const { return impl_->port; }

void DecoderServer::attach(SlotEngine& engine) {
  impl_->slot = std::make_unique<Slot>(engine, 0);
  impl_->engine.store(&engine);
}

Result<void> DecoderServer::listen() {
  if (impl_->port < 0) return fail(EINVAL, "listen() before bind()");
  if (impl_->stopping.load()) return {};
  if (!impl_->http.listen_after_bind() && !impl_->stopping.load()) {
    return fail(EIO, "HTTP server on {}:{} stopped unexpectedly", impl_->options.host, impl_->port);
  }
  return {};
}

void DecoderServer::stop() {
  impl_->stopping.store(true);
  impl_->http.stop();
}

}  // namespace kvshare::decoder
