// kvshare-mkmodel: writes a tiny random-weight GGUF model (docs/refmodel.md).
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <fstream>

#include "layout/tensor_type.h"
#include "refmodel/model_generator.h"

int main(int argc, char** argv) {
  using kvshare::refmodel::GeneratorOptions;
  CLI::App app{
      "Writes a tiny random-weight GGUF model with a byte-level BPE vocabulary and a ChatML template "
      "that llama.cpp loads and serves, one arch per memory kind. The same options give the same bytes."};
  GeneratorOptions o;
  std::string out, wtype = "f32";
  // Options whose default depends on the arch: set only when given (std::optional there).
  uint32_t n_layer = 0, ssm_n_group = 0, attn_every = 0;
  app.add_option("OUT.gguf", out, "output path")->required();
  app.add_option("--arch", o.arch,
                 "qwen3, qwen2, llama (KV cache), gemma3 (iSWA), mamba2 (recurrent), lfm2 (hybrid: short conv + "
                 "attention) or qwen35 (hybrid: Gated DeltaNet + gated attention, M-RoPE)")
      ->capture_default_str();
  auto* layers = app.add_option("--layers", n_layer, "block count (default 2; 4 for qwen35)");
  app.add_option("--embd", o.n_embd, "embedding length")->capture_default_str();
  app.add_option("--heads", o.n_head, "attention heads")->capture_default_str();
  app.add_option("--heads-kv", o.n_head_kv, "KV heads")->capture_default_str();
  app.add_option("--head-dim", o.head_dim, "head size (key_length = value_length); lfm2: always embd / heads")
      ->capture_default_str();
  app.add_option("--ff", o.n_ff, "feed-forward length")->capture_default_str();
  app.add_option("--ctx", o.n_ctx_train, "context_length written to the model")->capture_default_str();
  app.add_option("--wtype", wtype, "type of the 2-D weights: f32, f16, bf16 or q8_0")->capture_default_str();
  app.add_option("--seed", o.seed, "random seed")->capture_default_str();
  app.add_option("--residual-gain", o.residual_gain,
                 "scale of the projections into the residual stream: 1 = a tied model (qwen3, gemma3) echoes "
                 "the last token, ~3 = replies depend on the whole prompt")
      ->check(CLI::Range(0.01f, 100.0f))
      ->capture_default_str();
  app.add_flag("--shape-only", o.shape_only, "metadata and tensor infos only, no weights");
  app.add_option("--swa-window", o.n_swa, "gemma3: sliding window in tokens (even layers are SWA)")
      ->capture_default_str();
  app.add_option("--conv-kernel", o.ssm_d_conv, "mamba2, qwen35: ssm.conv_kernel; lfm2: shortconv.l_cache")
      ->capture_default_str();
  app.add_option("--ssm-state", o.ssm_d_state, "mamba2, qwen35: ssm.state_size (qwen35: GDN head size)")
      ->capture_default_str();
  app.add_option("--ssm-heads", o.ssm_n_head, "mamba2: SSM heads; qwen35: GDN value heads")->capture_default_str();
  auto* groups = app.add_option("--ssm-groups", ssm_n_group,
                                "mamba2: SSM groups (default 1); qwen35: GDN key heads "
                                "(default 2)");
  auto* every = app.add_option("--attn-every", attn_every,
                               "lfm2, qwen35: every Nth layer is attention, the others "
                               "recurrent (default 2 for lfm2, 4 for qwen35)");
  CLI11_PARSE(app, argc, argv);
  if (layers->count() > 0) o.n_layer = n_layer;
  if (groups->count() > 0) o.ssm_n_group = ssm_n_group;
  if (every->count() > 0) o.attn_every = attn_every;

  if (wtype == "f32")
    o.wtype = kvshare::layout::GgmlType::F32;
  else if (wtype == "f16")
    o.wtype = kvshare::layout::GgmlType::F16;
  else if (wtype == "bf16")
    o.wtype = kvshare::layout::GgmlType::BF16;
  else if (wtype == "q8_0")
    o.wtype = kvshare::layout::GgmlType::Q8_0;
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
