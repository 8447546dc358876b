#include "tools/cli/kv_flags.h"

namespace kvshare::tools {
namespace {

// Refuses a value at parse time with the layout parser's own message, so a bad -fa or
// cache type is bad usage (exit 2) in every tool, whatever the tool does next.
template <class Parse>
CLI::Validator parsed_by(Parse parse) {
  return CLI::Validator(
      [parse](std::string& value) {
        auto parsed = parse(value);
        return parsed ? std::string() : parsed.error().message();
      },
      "");
}

}  // namespace

std::vector<CLI::Option*> KvFlagOptions::all() const {
  std::vector<CLI::Option*> options;
  for (CLI::Option* option : {ctx_size, flash_attn, cache_type_k, cache_type_v, ubatch_size})
    if (option != nullptr) options.push_back(option);
  return options;
}

size_t KvFlagOptions::given() const {
  size_t count = 0;
  for (const CLI::Option* option : all()) count += option->count();
  return count;
}

KvFlagOptions add_kv_flags(CLI::App* app, KvFlags& flags, KvFlagSet set) {
  KvFlagOptions options;
  if (set.ctx_size)
    options.ctx_size =
        app->add_option("-c,--ctx-size", flags.n_ctx,
                        "-c: context size in tokens, as llama-server's -c (0: the model's context_length)")
            ->capture_default_str();
  // --fa, --ctk and --ctv: the two-dash spellings kvshare-prefill has always taken.
  options.flash_attn = app->add_option("--flash-attn,--fa", flags.flash_attn,
                                       "-fa: flash attention, on, off or auto (= on, as on a CPU llama-server); off "
                                       "transposes V in the cache")
                           ->check(parsed_by(layout::parse_flash_attn))
                           ->capture_default_str();
  options.cache_type_k =
      app->add_option("--cache-type-k,--ctk", flags.cache_type_k,
                      "-ctk: K cache type: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0 or q5_1")
          ->check(parsed_by([](std::string_view value) { return layout::parse_cache_type_flag("-ctk", value); }))
          ->capture_default_str();
  options.cache_type_v =
      app->add_option("--cache-type-v,--ctv", flags.cache_type_v,
                      "-ctv: V cache type, as -ctk (quantized needs -fa on)")
          ->check(parsed_by([](std::string_view value) { return layout::parse_cache_type_flag("-ctv", value); }))
          ->capture_default_str();
  if (set.ubatch_size)
    options.ubatch_size =
        app->add_option("--ubatch-size", flags.n_ubatch, "-ub: physical batch size (sizes the SWA cache)")
            ->capture_default_str();
  return options;
}

Result<layout::KvParams> to_kv_params(const KvFlags& flags, layout::KvParams base, KvFlagSet set) {
  if (set.ctx_size) base.n_ctx = flags.n_ctx;
  if (set.ubatch_size) base.n_ubatch = flags.n_ubatch;
  return layout::apply_kv_flags(base, flags.flash_attn, flags.cache_type_k, flags.cache_type_v);
}

}  // namespace kvshare::tools
