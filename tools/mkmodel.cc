// kvshare-mkmodel: writes a tiny random-weight GGUF model (docs/refmodel.md).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <fstream>

#include "layout/tensor_type.h"
#include "refmodel/model_generator.h"

int main(int argc, char** argv) {
  using kvshare::refmodel::GeneratorOptions;
  CLI::App app{"Writes a tiny random-weight llama/qwen2/qwen3 GGUF model with a byte-level BPE vocabulary and a "
               "ChatML template that llama.cpp loads and serves. The same options give the same bytes."};
  GeneratorOptions o;
  std::string out, wtype = "f32";
  app.add_option("OUT.gguf", out, "output path")->required();
  app.add_option("--arch", o.arch, "qwen3, qwen2 or llama")->capture_default_str();
  app.add_option("--layers", o.n_layer, "block count")->capture_default_str();
  app.add_option("--embd", o.n_embd, "embedding length")->capture_default_str();
  app.add_option("--heads", o.n_head, "attention heads")->capture_default_str();
  app.add_option("--heads-kv", o.n_head_kv, "KV heads")->capture_default_str();
  app.add_option("--head-dim", o.head_dim, "head size (key_length = value_length)")->capture_default_str();
  app.add_option("--ff", o.n_ff, "feed-forward length")->capture_default_str();
  app.add_option("--ctx", o.n_ctx_train, "context_length written to the model")->capture_default_str();
  app.add_option("--wtype", wtype, "type of the 2-D weights: f32, f16, bf16 or q8_0")->capture_default_str();
  app.add_option("--seed", o.seed, "random seed")->capture_default_str();
  app.add_option("--residual-gain", o.residual_gain,
                 "scale of the projections into the residual stream: 1 = replies echo the last token, "
                 "~3 = replies depend on the whole prompt")
      ->check(CLI::Range(0.01f, 100.0f))->capture_default_str();
  app.add_flag("--shape-only", o.shape_only, "metadata and tensor infos only, no weights");
  CLI11_PARSE(app, argc, argv);

  if (wtype == "f32") o.wtype = kvshare::layout::GgmlType::F32;
  else if (wtype == "f16") o.wtype = kvshare::layout::GgmlType::F16;
  else if (wtype == "bf16") o.wtype = kvshare::layout::GgmlType::BF16;
  else if (wtype == "q8_0") o.wtype = kvshare::layout::GgmlType::Q8_0;
  else {
    fmt::print(stderr, "kvshare-mkmodel: --wtype {}: not one of f32, f16, bf16, q8_0\n", wtype);
    return 2;
  }
  if (auto ok = kvshare::refmodel::validate(o); !ok) {
    fmt::print(stderr, "kvshare-mkmodel: {}\n", ok.error().what());
    return 2;
  }
  std::ofstream file(out, std::ios::binary | std::ios::trunc);
  if (!file) {
    fmt::print(stderr, "kvshare-mkmodel: cannot create {}\n", out);
    return 1;
  }
  auto ok = kvshare::refmodel::generate_model(o, [&](std::span<const std::byte> bytes) -> kvshare::Result<void> {
    file.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    if (!file) return kvshare::fail(EIO, "writing {}", out);
    return {};
  });
  if (ok) {
    file.close();
    if (!file) ok = kvshare::fail(EIO, "closing {}", out);
  }
  if (!ok) {
    fmt::print(stderr, "kvshare-mkmodel: {}\n", ok.error().what());
    std::remove(out.c_str());
    return 1;
  }
  return 0;
}
