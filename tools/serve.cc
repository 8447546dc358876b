// kvshare-serve: an OpenAI-style server whose prompts are prefilled by a provider and
// decoded by a llama-server child (kvshare-decoder when named) — the hybrid route. docs/hybrid.md.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "layout/llama_flags.h"
#include "route/api_key.h"
#include "route/serve.h"
#include "route/serve_config.h"
#include "tools/cli/kv_flags.h"

int main(int argc, char** argv) {
  using namespace kvshare::route;
  ServeConfig config;
  std::string device = "hybrid";
  CLI::App app{"kvshare-serve: prefill on a provider, decode on llama-server, one OpenAI-style endpoint"};
  app.add_option("-m,--model", config.model, "the model (.gguf)")->required();
  app.add_option("--device", device, "hybrid (provider prefills, decoder decodes) or cpu (plain relay)")
      ->check(CLI::IsMember({"hybrid", "cpu"}));
  app.add_option("--prefill-provider", config.prefill_provider, "the provider program (else ONEBIT_HYBRID_PREFILL)");
  app.add_flag("--provider-resident", config.provider_resident,
               "start the provider once and keep it (PROG --model M --serve-fd 3): the model stays loaded and the "
               "decoder's region mapped across requests; restarted if it exits or stops answering "
               "(docs/provider.md, \"The resident provider\")");
  app.add_option("--prefill-provider-socket", config.prefill_provider_socket,
                 "a resident provider listening on this AF_UNIX socket (started elsewhere, e.g. kvshare-prefill "
                 "--serve PATH; the directory must be 0700 and this user's)");
  app.add_option("--prefill-remote", config.prefill_remote,
                 "http://HOST:PORT of a kvshare-provider-server: prompts are prefilled there and their KV moved into "
                 "the decoder over UCX (docs/remote.md); give it once per prefill host: serve picks the least busy "
                 "(the one holding the slot's conversation first) and fails over to the others");
  std::string remote_route = "auto";
  app.add_option("--prefill-remote-route", remote_route,
                 "how --prefill-remote reaches the decoder: ucx (the provider server writes into the decoder's "
                 "cells: the patched llama-server or kvshare-decoder), state (it answers a state file bound to the "
                 "model, the tokenizer and the state version, which the decoder restores: any llama-server), or auto "
                 "(ucx when the decoder answers the share action, else state); docs/remote.md")
      ->capture_default_str();
  std::string remote_key_file;
  app.add_option("--prefill-remote-key-file", remote_key_file,
                 "a file whose first key goes to the provider server as \"Authorization: Bearer KEY\" (else "
                 "KVSHARE_REMOTE_KEY; never on the command line, which any local user can read)");
  app.add_option("--host", config.host, "address to listen on")->capture_default_str();
  app.add_option("--port", config.port, "port to listen on (0: any free port)")->capture_default_str();
  auto* ctx = app.add_option("-c,--ctx-size", config.ctx_size, "decoder context (tokens)")->capture_default_str();
  // -c is serve's own (the decoder's context, which must be positive); -fa, -ctk and -ctv
  // go to the decoder as given, `auto` included.
  kvshare::tools::KvFlags kv;
  const kvshare::tools::KvFlagOptions kv_options = kvshare::tools::add_kv_flags(&app, kv, {.ctx_size = false});
  app.add_option("--provider-timeout", config.provider_timeout_s, "seconds before a provider is killed")
      ->capture_default_str();
  std::string handoff = "auto";
  app.add_option("--handoff", handoff,
                 "when a prompt is handed to the provider: auto (when measured rates say it is sooner than the "
                 "decoder evaluating what its slot does not hold), always, never, or N (when the provider would "
                 "prefill at least N tokens); docs/hybrid.md")
      ->capture_default_str();
  double stream_weight = kDefaultStreamWeight;
  app.add_option("--stream-weight", stream_weight,
                 "--handoff auto under load: how many ms of an arriving request's first byte one ms of one decoding "
                 "stream's stall is worth; a prompt the decoder would prefill while other slots decode is handed off "
                 "when its stall of them outweighs the provider's extra time (0: the load is not weighed); "
                 "docs/hybrid.md, \"Under load\"")
      ->capture_default_str();
  app.add_option("--backend", config.backend,
                 "the decoder: llama-server, patched by integrations/llama.cpp for the shared route (default: "
                 "llama-server on PATH); build/bin/kvshare-decoder runs the reference decoder");
  app.add_flag("--print-backend", config.print_backend, "print the decoder's command line and exit");
  app.add_option("--parallel", config.parallel,
                 "-np: the decoder's slots (1..256); each request is handed into a free slot, one KV stream each "
                 "(several need llama-server; docs/hybrid.md, \"Many slots\")")
      ->capture_default_str();
  std::vector<std::string> refused_with_value;
  bool mtp = false, dflash = false, embedding = false, reranking = false;
  std::string mmproj, moe_slots, pm;
  app.add_flag("--mtp", mtp, "refused");
  app.add_flag("--dflash", dflash, "refused");
  app.add_flag("--embedding,--embeddings", embedding, "refused");
  app.add_flag("--reranking,--rerank", reranking, "refused");
  auto* mmproj_option = app.add_option("--mmproj", mmproj, "refused");
  auto* moe_option = app.add_option("--moe-slots", moe_slots, "refused");
  auto* pm_option = app.add_option("--pm", pm, "refused")->expected(0, 1);
  std::string api_key;
  app.add_option("--api-key", api_key,
                 "API key(s), comma-separated: clients need \"Authorization: Bearer KEY\" (not /health); the "
                 "decoder gets the same keys through LLAMA_API_KEY")
      ->envname("LLAMA_API_KEY");
  app.add_option("backend_flags", config.backend_extra, "flags after -- go to the decoder");
  try {
    // CLI11 wants the arguments last-first.
    std::vector<std::string> args =
        kvshare::layout::normalize_llama_flags(std::vector<std::string>(argv + 1, argv + argc));
    std::reverse(args.begin(), args.end());
    app.parse(args);
  } catch (const CLI::ParseError& error) {
    return app.exit(error) == 0 ? 0 : 2;
  }
  config.device = device == "cpu" ? Device::cpu : Device::hybrid;
  if (auto policy = parse_handoff_policy(handoff); policy) {
    config.handoff = *policy;
    config.handoff.stream_weight = stream_weight;
  } else {
    std::fprintf(stderr, "kvshare-serve: %s\n", policy.error().what().c_str());
    return 2;
  }
  if (auto route = parse_remote_route_kind(remote_route); route) {
    config.prefill_remote_route = *route;
  } else {
    std::fprintf(stderr, "kvshare-serve: %s\n", route.error().what().c_str());
    return 2;
  }
  config.api_keys = parse_api_key_list(api_key);
  // The decoder child inherits the environment, not a command line any user can read;
  // no thread exists yet, so setenv is safe here.
  if (!api_key.empty()) ::setenv("LLAMA_API_KEY", api_key.c_str(), 1);
  if (const char* remote_key = std::getenv("KVSHARE_REMOTE_KEY")) config.prefill_remote_key = remote_key;
  if (!remote_key_file.empty()) {
    auto keys = read_api_key_file(remote_key_file);
    if (!keys || keys->empty()) {
      std::fprintf(stderr, "kvshare-serve: --prefill-remote-key-file %s: %s\n", remote_key_file.c_str(),
                   keys ? "holds no key (one per line, # for comments)" : keys.error().what().c_str());
      return 2;
    }
    config.prefill_remote_key = keys->front();
  }
  config.flash_attn = kv.flash_attn;
  config.cache_type_k = kv.cache_type_k;
  config.cache_type_v = kv.cache_type_v;
  config.kv_flags_given = ctx->count() + kv_options.given() > 0;
  if (mtp) config.refused_flags.push_back("--mtp");
  if (dflash) config.refused_flags.push_back("--dflash");
  if (mmproj_option->count()) config.refused_flags.push_back("--mmproj");
  if (moe_option->count()) config.refused_flags.push_back("--moe-slots");
  if (embedding) config.refused_flags.push_back("--embedding");
  if (reranking) config.refused_flags.push_back("--reranking");
  if (pm_option->count()) config.refused_flags.push_back("--pm");

  apply_env(config, read_serve_env());
  if (auto valid = validate(config); !valid) {
    std::fprintf(stderr, "kvshare-serve: %s\n", valid.error().what().c_str());
    return 2;
  }
  auto backend = resolve_backend(config, read_serve_env().path, own_binary_dir());
  if (!backend) {
    std::fprintf(stderr, "kvshare-serve: %s\n", backend.error().what().c_str());
    return 1;
  }
  if (auto valid = validate_backend(config, *backend); !valid) {
    std::fprintf(stderr, "kvshare-serve: %s\n", valid.error().what().c_str());
    return 2;
  }
  if (config.print_backend) {
    std::printf("%s\n", print_backend_line(config, *backend).c_str());
    return 0;
  }
  return run_serve(config, *backend, ServeRuntime{own_binary_dir()});
}
