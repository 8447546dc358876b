// kvshare-decoder: the reference decoder, llama-server's slot API with its KV cache in a
// kvshare region. docs/decoder.md.
#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include "apps/decoder/decoder_app.h"
#include "layout/llama_flags.h"
#include "refmodel/blas_kernels.h"
#include "tools/cli/kv_flags.h"

int main(int argc, char** argv) {
  kvshare::refmodel::reexec_with_best_blas_kernels(argv);  // before any work: it may exec
  using kvshare::decoder::DecoderOptions;
  DecoderOptions o;
  CLI::App app{
      "kvshare-decoder: a one-slot llama-server subset (completion, chat, tokenize, slots save/restore/"
      "erase/share/adopt) over the CPU reference transformer. ONEBIT_KV_SHARE set and non-empty: the KV "
      "cache lives in an exported region and ?action=share/adopt work."};
  std::string model;
  app.add_option("-m,--model", model, "GGUF model to load")->required();
  kvshare::tools::KvFlags kv;
  kv.n_ctx = 0;  // the model's training context
  const kvshare::tools::KvFlagSet kv_set{.ctx_size = true, .ubatch_size = true};
  kvshare::tools::add_kv_flags(&app, kv, kv_set);
  app.add_option("--parallel", o.n_parallel, "slots (-np); only 1 is supported");
  std::string slot_save_path;
  app.add_option("--slot-save-path", slot_save_path, "directory for ?action=save|restore (enables slot actions)");
  app.add_option("--host", o.host, "address to listen on");
  app.add_option("--port", o.port, "port to listen on (0: any free port)");
  app.add_option("-t,--threads", o.n_threads, "CPU threads for the forward pass (0: all)");
  app.add_flag("!--no-slots", o.endpoint_slots, "disable GET /slots");
  app.add_option("--state-version", o.state_version,
                 "state-file version saved and restored, as the llama-server it stands in for: 2 (d32676d) or 3 "
                 "(current); another version is refused on restore")
      ->check(CLI::IsMember({2, 3}))
      ->capture_default_str();
  app.add_option("--api-key", o.api_key,
                 "API key(s), comma-separated: every route but /health needs \"Authorization: Bearer KEY\"; "
                 "slot actions (share hands out the KV memory) above all")
      ->envname("LLAMA_API_KEY");
  std::string api_key_file;
  app.add_option("--api-key-file", api_key_file, "file of API keys, one per line (# starts a comment)")
      ->envname("LLAMA_ARG_API_KEY_FILE");
  int ignored_gpu_layers = 0;
  app.add_option("--n-gpu-layers", ignored_gpu_layers, "-ngl: accepted for llama-server compatibility, ignored (CPU)");

  std::vector<std::string> args(argv + 1, argv + argc);
  args = kvshare::layout::normalize_llama_flags(std::move(args));
  std::reverse(args.begin(), args.end());
  try {
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  o.n_ctx = static_cast<int>(kv.n_ctx);
  o.flash_attn = kv.flash_attn;
  o.cache_type_k = kv.cache_type_k;
  o.cache_type_v = kv.cache_type_v;
  o.n_ubatch = static_cast<int>(kv.n_ubatch);
  o.model = model;
  o.slot_save_path = slot_save_path;
  o.api_key_file = api_key_file;
  return kvshare::decoder::run_decoder(o);
}
