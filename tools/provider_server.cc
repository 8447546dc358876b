// kvshare-provider-server: the prefill host of the remote route. Prefills prompts with
// the CPU reference transformer and pushes their KV into a decoder on another host over
// UCX, as the decoder's offer says. Every request but GET /health needs the deployment's
// key. docs/remote.md.
#include <CLI/CLI.hpp>

#include <cerrno>
#include <cstdio>
#include <cstdlib>

#include "apps/provider/provider_server.h"

int main(int argc, char** argv) {
  kvshare::refmodel::ProviderServerOptions o;
  kvshare::refmodel::ProviderKeySources keys;
  CLI::App app{
      "kvshare-provider-server: POST /prefill {\"tokens\": [...], \"share\": <offer>} prefills with the "
      "reference model and writes the KV into the offering decoder's cells over UCX. Every request but "
      "GET /health needs the deployment's key (\"Authorization: Bearer KEY\"): --api-key-file, "
      "KVSHARE_REMOTE_KEY or --api-key"};
  app.add_option("-m,--model", o.model_path, "GGUF model to load")->required();
  app.add_option("--host", o.host, "address to listen on")->capture_default_str();
  app.add_option("--port", o.port, "port to listen on (0: any free port)")->capture_default_str();
  app.add_option("-t,--threads", o.n_threads, "CPU threads for the forward pass (0: all)");
  app.add_option("--provider-command", o.provider_command,
                 "prefill with this program (NPU engine, kvshare-prefill) on the file route's contract instead of "
                 "the reference model; its state file's rows are sent");
  app.add_option("--provider-timeout", o.provider_timeout_s, "seconds before the provider command is killed")
      ->capture_default_str();
  app.add_option("--parallel", o.parallel,
                 "prefills run at once, each with its own working memory over the one mapped model")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  app.add_option("--queue", o.queue,
                 "requests that wait for a prefill when --parallel run; one past it is answered 503 at once")
      ->check(CLI::Range(0, 4096))
      ->capture_default_str();
  app.add_option("--api-key", keys.api_key,
                 "API key(s), comma-separated, as llama-server. Warning: a key on the command line is visible to "
                 "every local user in /proc/PID/cmdline; prefer --api-key-file or KVSHARE_REMOTE_KEY");
  app.add_option("--api-key-file", keys.api_key_file, "file of API keys, one per line (# starts a comment)");
  app.add_flag("--no-api-key", keys.no_api_key,
               "serve without a key: anyone who reaches the port can make it prefill and push KV rows");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  keys.env_key = std::getenv(kvshare::refmodel::kRemoteKeyEnv);
  auto accepted = kvshare::refmodel::resolve_provider_keys(keys);
  if (!accepted) {
    // Usage faults (EINVAL) read as a sentence; a key file that cannot be opened keeps its errno text.
    const auto& e = accepted.error();
    std::fprintf(stderr, "kvshare-provider-server: %s\n", (e.errno_value() == EINVAL ? e.message() : e.what()).c_str());
    return 2;
  }
  o.api_keys = std::move(*accepted);
  return kvshare::refmodel::run_provider_server(o);
}
