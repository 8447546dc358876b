// kvshare-layout-dump: prints the KV region a decoder would export for a model and
// llama-server's KV flags, or its layout header (--json); --header checks a header file.
// Exit codes: 0 ok, 1 failed (bad model, bad header, I/O), 2 bad usage.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "kvshare/mapping.h"
#include "layout/gguf_reader.h"
#include "layout/layout_dump.h"
#include "layout/llama_flags.h"
#include "layout/model_shape.h"
#include "tools/cli/kv_flags.h"

namespace {

int print_error(const kvshare::Error& error) {
  std::fprintf(stderr, "kvshare-layout-dump: %s\n", error.what().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kvshare;
  CLI::App app{fmt::format(
      "Prints the KV cache region llama.cpp (patched by integrations/llama.cpp) would export for MODEL: per "
      "tensor its name, type, shape, chunk, offset and padded size; per chunk its size and layout hash; totals. "
      "Shape-only GGUFs (no tensor data) work.\nSupported archs: {}",
      fmt::join(layout::supported_archs(), ", "))};
  app.name("kvshare-layout-dump");

  std::string model_path;
  std::string header_path;
  layout::KvParams params;
  tools::KvFlags kv;
  const tools::KvFlagSet kv_set{.ctx_size = true, .ubatch_size = true};
  bool as_json = false;

  app.add_option("MODEL", model_path, "GGUF model file (weights not needed)");
  app.add_option("--header", header_path, "decode and validate a layout header file instead");
  kv.n_ctx = 0;  // llama-server's default: the model's context_length
  tools::add_kv_flags(&app, kv, kv_set);
  app.add_option("--parallel", params.n_seq_max, "-np: number of sequences (slots)")->capture_default_str();
  params.kv_unified = false;
  app.add_flag("--kv-unified", params.kv_unified, "-kvu: one KV stream shared by every sequence");
  app.add_flag("--swa-full", params.swa_full, "full-size SWA cache");
  app.add_flag("--json", as_json, "print the layout header (JSON) instead of the report");

  try {
    std::vector<std::string> args = kvshare::layout::normalize_llama_flags({argv + 1, argv + argc});
    std::reverse(args.begin(), args.end());  // CLI11 takes the vector last-first
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }

  if (!header_path.empty()) {
    if (!model_path.empty()) {
      std::fprintf(stderr, "kvshare-layout-dump: give either MODEL or --header, not both\n");
      return 2;
    }
    auto mapping = Mapping::map_file_readonly(header_path);
    if (!mapping) return print_error(mapping.error());
    const std::string_view text(reinterpret_cast<const char*>(mapping->data()), mapping->size());
    auto report = layout::render_header_check(text, header_path);
    if (!report) return print_error(report.error());
    std::fputs(report->c_str(), stdout);
    return 0;
  }
  if (model_path.empty()) {
    std::fprintf(stderr, "kvshare-layout-dump: a MODEL file or --header FILE is required (see --help)\n");
    return 2;
  }

  auto with_flags = tools::to_kv_params(kv, params, kv_set);
  if (!with_flags) {
    std::fprintf(stderr, "kvshare-layout-dump: %s\n", with_flags.error().what().c_str());
    return 2;
  }
  params = *with_flags;
  // A single sequence is always unified in llama.cpp (one stream either way).
  if (params.n_seq_max == 1) params.kv_unified = true;
  if (auto valid = layout::validate(params); !valid) {
    std::fprintf(stderr, "kvshare-layout-dump: %s\n", valid.error().what().c_str());
    return 2;
  }

  auto mapping = Mapping::map_file_readonly(model_path);
  if (!mapping) return print_error(mapping.error());
  auto file = layout::parse_gguf(std::span<const std::byte>(mapping->data(), mapping->size()), model_path);
  if (!file) return print_error(file.error());
  auto output = layout::render_layout_dump(*file, params, as_json);
  if (!output) return print_error(output.error());
  std::fputs(output->c_str(), stdout);
  return 0;
}
