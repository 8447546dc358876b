// kvshare-provider-server: the prefill host of the remote route. Prefills prompts with
// the CPU reference transformer and pushes their KV into a decoder on another host over
// UCX, as the decoder's offer says. docs/remote.md.
#include <CLI/CLI.hpp>

#include "refmodel/provider/provider_server.h"

int main(int argc, char** argv) {
  kvshare::refmodel::ProviderServerOptions o;
  CLI::App app{"kvshare-provider-server: POST /prefill {\"tokens\": [...], \"share\": <offer>} prefills with the "
               "reference model and writes the KV into the offering decoder's cells over UCX"};
  app.add_option("-m,--model", o.model_path, "GGUF model to load")->required();
  app.add_option("--host", o.host, "address to listen on")->capture_default_str();
  app.add_option("--port", o.port, "port to listen on (0: any free port)")->capture_default_str();
  app.add_option("-t,--threads", o.n_threads, "CPU threads for the forward pass (0: all)");
  app.add_option("--provider-command", o.provider_command,
                 "prefill with this program (NPU engine, kvshare-prefill) on the file route's contract instead of "
                 "the reference model; its state file's rows are sent");
  app.add_option("--provider-timeout", o.provider_timeout_s, "seconds before the provider command is killed")
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  return kvshare::refmodel::run_provider_server(o);
}
