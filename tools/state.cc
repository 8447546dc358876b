// kvshare-state: inspect, verify, diff and convert llama.cpp sequence-state files
// (docs/state-file.md). Exit 0 ok, 1 failed (or a diff past the tolerance), 2 bad usage.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "kvshare/statefile/state_tools.h"
#include "layout/kv_params.h"
#include "layout/llama_flags.h"
#include "tools/cli/kv_flags.h"

namespace {

// llama-server's spellings (-np, -ctk, -fa, ...) read as they do for llama-server; CLI11's
// vector form takes the arguments last-first.
std::vector<std::string> llama_style_args(int argc, char** argv) {
  std::vector<std::string> args = kvshare::layout::normalize_llama_flags({argv + 1, argv + argc});
  std::reverse(args.begin(), args.end());
  return args;
}

int report_failure(const kvshare::Error& error) {
  fmt::print(stderr, "kvshare-state: {}\n", error.what());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  namespace sf = kvshare::statefile;
  CLI::App app{
      "Inspects, verifies, compares and converts llama.cpp sequence-state files (the files "
      "llama-server's /slots/<id>?action=save writes and action=restore reads)."};
  app.name("kvshare-state");
  app.require_subcommand(1);

  std::string file, model, other, out;
  bool json = false;
  auto* inspect = app.add_subcommand("inspect", "header, cells, per-layer types, sizes and K/V statistics");
  inspect->add_option("FILE", file, "state file")->required();
  inspect->add_flag("--json", json, "one JSON object instead of text");

  kvshare::layout::KvParams params;
  kvshare::tools::KvFlags kv;
  const kvshare::tools::KvFlagSet kv_set{.ctx_size = true, .ubatch_size = true};
  auto* verify = app.add_subcommand("verify", "does FILE restore into MODEL.gguf with these KV params?");
  verify->add_option("FILE", file, "state file")->required();
  verify->add_option("MODEL.gguf", model, "the decoder's model")->required();
  kvshare::tools::add_kv_flags(verify, kv, kv_set);
  verify->add_option("--parallel", params.n_seq_max, "slots, -np")->capture_default_str();
  verify->add_flag("--kv-unified,!--no-kv-unified", params.kv_unified, "unified KV cache across slots, -kvu");
  verify->add_flag("--swa-full", params.swa_full, "full-size SWA cache");

  double tolerance = 0.0;
  sf::RotationInfo rotation;
  uint32_t head_dim = 0;
  bool no_rotation = false;
  auto* diff = app.add_subcommand("diff", "per-layer max abs/rel difference of K and V after dequantization");
  diff->add_option("A", file, "first state file")->required();
  diff->add_option("B", other, "second state file")->required();
  diff->add_option("--tolerance", tolerance, "largest max-abs difference that still exits 0")->capture_default_str();

  std::string convert_ctk, convert_ctv;
  uint32_t to_version = 0;
  auto* convert = app.add_subcommand("convert", "rewrite with other K/V cache types or for another state version");
  convert->add_option("IN", file, "state file to read")->required();
  convert->add_option("OUT", out, "state file to write (atomically)")->required();
  convert->add_option("--cache-type-k,--ctk", convert_ctk, "K cache type of OUT (-ctk; default: IN's)");
  convert->add_option("--cache-type-v,--ctv", convert_ctv, "V cache type of OUT (-ctv; default: IN's)");
  convert
      ->add_option("--to-version", to_version,
                   "state version of OUT: 2 (llama-server d32676d) or 3 (current llama-server); default: IN's")
      ->check(CLI::IsMember({2, 3}));

  for (auto* sub : {diff, convert}) {
    sub->add_option("--head-dim", head_dim, "head size of K and V (llama.cpp rotates quantized caches by it)");
    sub->add_option("--head-dim-k", rotation.n_embd_head_k, "head size of K, if it differs");
    sub->add_option("--head-dim-v", rotation.n_embd_head_v, "head size of V, if it differs");
    sub->add_flag("--no-rotation", no_rotation, "the caches were written with LLAMA_ATTN_ROT_DISABLE=1");
  }
  try {
    app.parse(llama_style_args(argc, argv));
  } catch (const CLI::ParseError& error) {
    const int code = app.exit(error);
    return code == 0 ? 0 : 2;
  }

  if (head_dim != 0) {
    if (rotation.n_embd_head_k == 0) rotation.n_embd_head_k = head_dim;
    if (rotation.n_embd_head_v == 0) rotation.n_embd_head_v = head_dim;
  }
  rotation.rotation_disabled = no_rotation;

  if (inspect->parsed()) {
    auto text = sf::inspect_state_file(file, json);
    if (!text) return report_failure(text.error());
    fmt::print("{}", *text);
    return 0;
  }
  if (verify->parsed()) {
    auto with_flags = kvshare::tools::to_kv_params(kv, params, kv_set);
    if (!with_flags) {
      fmt::print(stderr, "kvshare-state: {}\n", with_flags.error().what());
      return 2;
    }
    auto summary = sf::verify_state_file(file, model, *with_flags);
    if (!summary) return report_failure(summary.error());
    fmt::print("{}\n", *summary);
    return 0;
  }
  if (diff->parsed()) {
    auto report = sf::diff_state_files(file, other, tolerance, rotation);
    if (!report) return report_failure(report.error());
    fmt::print("{}", report->text);
    return report->within_tolerance ? 0 : 1;
  }
  sf::ConvertOptions options;
  options.type_k.reset();
  options.type_v.reset();
  for (auto [flag, name, target] :
       {std::tuple{"-ctk", &convert_ctk, &options.type_k}, std::tuple{"-ctv", &convert_ctv, &options.type_v}}) {
    if (name->empty()) continue;
    auto type = kvshare::layout::parse_cache_type_flag(flag, *name);
    if (!type) {
      fmt::print(stderr, "kvshare-state: {}\n", type.error().what());
      return 2;
    }
    *target = *type;
  }
  options.rotation = rotation;
  options.to_version = to_version;
  auto info = sf::convert_state_file(file, out, options);
  if (!info) return report_failure(info.error());
  fmt::print("wrote {} ({} bytes, state version {}, -ctk {} -ctv {})\n", info->path.string(), info->size_bytes,
             info->state_version, convert_ctk.empty() ? "as IN" : convert_ctk,
             convert_ctv.empty() ? "as IN" : convert_ctv);
  return 0;
}
