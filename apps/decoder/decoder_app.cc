#include "apps/decoder/decoder_app.h"

#include "kvshare/stop_signals.h"
#include "layout/state_format.h"

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <map>
#include <thread>

#include <cstdlib>
#include "apps/decoder/http_server.h"
#include "apps/decoder/refmodel_engine.h"
#include "layout/kv_params.h"
#include "route/api_key.h"

namespace kvshare::decoder {

namespace {

struct ResolvedParams {
  layout::KvParams params;
  std::string error;
};

ResolvedParams resolve_params(const DecoderOptions& o) {
  ResolvedParams r;
  layout::KvParams base;
  base.n_ctx = static_cast<uint32_t>(o.n_ctx);
  base.n_seq_max = 1;
  base.kv_unified = true;
  base.n_ubatch = static_cast<uint32_t>(o.n_ubatch);
  auto params = layout::apply_kv_flags(base, o.flash_attn, o.cache_type_k, o.cache_type_v);
  if (!params) {
    r.error = params.error().what();
    return r;
  }
  r.params = *params;
  if (auto valid = layout::validate(r.params); !valid) r.error = valid.error().what();
  return r;
}

}  // namespace

int run_decoder(const DecoderOptions& options) {
  if (options.n_parallel != 1) {
    std::fprintf(stderr,
                 "kvshare-decoder: -np %d: this decoder serves exactly one slot (-np 1), the slot the hybrid route "
                 "hands prompts to; run llama-server for several slots\n",
                 options.n_parallel);
    return 2;
  }
  const ResolvedParams resolved = resolve_params(options);
  if (!resolved.error.empty()) {
    std::fprintf(stderr, "kvshare-decoder: %s\n", resolved.error.c_str());
    return 2;
  }
  if (!options.slot_save_path.empty() && !std::filesystem::is_directory(options.slot_save_path)) {
    std::fprintf(stderr, "kvshare-decoder: --slot-save-path %s: not an existing directory\n",
                 options.slot_save_path.c_str());
    return 2;
  }
  if (options.state_version < 0 || !layout::is_known_state_version(static_cast<uint32_t>(options.state_version))) {
    std::fprintf(stderr, "kvshare-decoder: --state-version %d: llama.cpp state files are version 2 or 3\n",
                 options.state_version);
    return 2;
  }

  std::vector<std::string> api_keys = route::parse_api_key_list(options.api_key);
  if (!options.api_key_file.empty()) {
    auto from_file = route::read_api_key_file(options.api_key_file);
    if (!from_file) {
      std::fprintf(stderr, "kvshare-decoder: %s\n", from_file.error().what().c_str());
      return 2;
    }
    api_keys.insert(api_keys.end(), from_file->begin(), from_file->end());
  }

  // Every thread made from here on inherits the blocked set; one watcher takes the signals
  // (kvshare/stop_signals.h).
  kvshare::install_stop_signals();
  signal(SIGPIPE, SIG_IGN);

  ServerOptions server_options;
  server_options.host = options.host;
  server_options.port = options.port;
  server_options.slot_save_path = options.slot_save_path;
  server_options.model_name = options.model.string();
  server_options.endpoint_slots = options.endpoint_slots;
  server_options.api_keys = std::move(api_keys);
  DecoderServer server(server_options);
  if (auto bound = server.bind(); !bound) {
    std::fprintf(stderr, "kvshare-decoder: %s\n", bound.error().what().c_str());
    return 1;
  }
  std::fprintf(stderr, "kvshare-decoder: server is listening on http://%s:%d\n", options.host.c_str(),
               server.bound_port());

  std::atomic<bool> listen_done{false};
  std::thread listener([&] {
    if (auto served = server.listen(); !served) {
      std::fprintf(stderr, "kvshare-decoder: %s\n", served.error().what().c_str());
    }
    listen_done.store(true);
  });

  int exit_code = 0;
  RefEngineOptions engine_options;
  engine_options.model_path = options.model;
  engine_options.model_name = options.model.filename().string();
  engine_options.params = resolved.params;
  engine_options.n_threads = options.n_threads;
  engine_options.state_version = static_cast<uint32_t>(options.state_version);
  // "Set and non-empty", as kvshare::share_requested reads it (kvshare/env.h): ONEBIT_KV_SHARE=0 is on too.
  const char* share_flag = std::getenv("ONEBIT_KV_SHARE");
  engine_options.share_requested = share_flag != nullptr && share_flag[0] != '\0';
  auto engine = load_refmodel_engine(engine_options);
  if (!engine) {
    std::fprintf(stderr, "kvshare-decoder: %s\n", engine.error().what().c_str());
    exit_code = 1;
  } else {
    server.attach(**engine);
    std::fprintf(stderr, "kvshare-decoder: model loaded: %s, n_ctx %d, %s\n", options.model.c_str(), (*engine)->n_ctx(),
                 layout::describe(resolved.params).c_str());
    // Wait for SIGINT/SIGTERM, or for the server to end by itself.
    while (!listen_done.load()) {
      const int sig = kvshare::wait_stop_signal(std::chrono::milliseconds(200));
      if (sig == SIGINT || sig == SIGTERM) {
        std::fprintf(stderr, "kvshare-decoder: %s: shutting down\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
        break;
      }
    }
  }
  // stop() before the listener has started listening would be lost: repeat until it ends.
  while (!listen_done.load()) {
    server.stop();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  listener.join();
  return exit_code;
}

}  // namespace kvshare::decoder
