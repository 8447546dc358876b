// Internal to the model generator (model_generator.cc): one ArchSpec per arch, with its
// checks, hyperparameter keys and tensor list. The lists mirror llama.cpp's
// load_arch_hparams / load_arch_tensors (src/models/<arch>.cpp), which refuse a file with
// a tensor missing or one too many.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "layout/error.h"
#include "layout/gguf_writer.h"
#include "refmodel/model_generator.h"

namespace kvshare::refmodel::detail {

// Values offset + scale * U[-1, 1].
struct Init {
  float scale = 0.0f;
  float offset = 0.0f;
};

// Norm weights near 1.
inline constexpr Init kNorm{0.1f, 1.0f};

// Adds generated tensors to a writer. Each tensor's values come from a stream keyed by
// the seed and its name, so adding a tensor does not change the others. The first failure
// is kept and later adds do nothing: an arch's tensor list reads as a plain list.
class TensorAdder {
 public:
  TensorAdder(layout::GgufWriter& writer, const GeneratorOptions& options, int64_t n_vocab,
              std::vector<int64_t> control_ids, bool is_tied);

  // A matrix in options.wtype, {fan_in, n_out}, values within ±scale.
  void weight(const std::string& name, int64_t fan_in, int64_t n_out, float scale);
  // f32 whatever --wtype: norms, biases, SSM parameters and conv kernels (ggml_ssm_conv
  // takes f32 kernels only).
  void f32(const std::string& name, std::vector<int64_t> ne, Init init);
  void norm(const std::string& name, int64_t n) { f32(name, {n}, kNorm); }

  // token_embd.weight {n_embd, n_vocab}: entries of unit size, so tied logits have wide margins.
  void token_embd();
  // output.weight {n_embd, n_vocab} unless tied. With zero_control_rows the rows of the
  // control tokens are 0: their logit is 0 while the best of the others is well above it,
  // so a greedy reply never stops at EOS or emits <|im_start|>.
  void output(bool zero_control_rows = false);
  // ffn_gate and ffn_up {n_embd, n_ff}, ffn_down {n_ff, n_embd} (scaled by the gain).
  void swiglu_ffn(const std::string& prefix);

  // ~1/sqrt(fan_in) (uniform values of that range have variance 1/fan_in), so the
  // residual stream stays O(1).
  static float proj(int64_t fan_in);
  // proj() times --residual-gain: for projections that write into the residual stream.
  float residual(int64_t fan_in) const { return options_.residual_gain * proj(fan_in); }

  const GeneratorOptions& options() const { return options_; }
  bool is_tied() const { return is_tied_; }
  Result<void> status() const { return status_; }

 private:
  void add(const std::string& name, layout::GgmlType type, std::vector<int64_t> ne, Init init,
           std::vector<int64_t> zero_rows = {});

  layout::GgufWriter& writer_;
  const GeneratorOptions& options_;
  int64_t n_vocab_;
  std::vector<int64_t> control_ids_;
  bool is_tied_;
  Result<void> status_;
};

// The options with the arch's defaults filled in (n_layer, ssm_n_group, attn_every).
struct Resolved {
  const GeneratorOptions& o;
  uint32_t n_layer;
  uint32_t ssm_n_group;
  uint32_t attn_every;
  // lfm2, qwen35: layer il is attention, not recurrent.
  bool is_attention(uint32_t il) const { return attn_every != 0 && (il + 1) % attn_every == 0; }
};

struct ArchSpec {
  const char* name;
  uint32_t default_layers;
  uint32_t default_ssm_n_group;  // 0: the arch has no SSM groups
  uint32_t default_attn_every;   // 0: not a hybrid
  bool tied_by_default;
  // Arch-specific checks beyond the common ones; errors name the option.
  Result<void> (*check)(const Resolved& r);
  // The "{arch}." hyperparameter keys after block_count, context_length, embedding_length.
  void (*write_keys)(layout::GgufWriter& w, const Resolved& r);
  void (*write_tensors)(TensorAdder& t, const Resolved& r);
};

// Fails when a row length is not whole blocks of --wtype, naming what the length is.
Result<void> check_rows(const GeneratorOptions& o, std::initializer_list<std::pair<const char*, int64_t>> rows);

// Per family: llama, qwen2, qwen3, gemma3 (generator_transformer.cc); mamba2, lfm2,
// qwen35 (generator_recurrent.cc).
const std::vector<ArchSpec>& transformer_archs();
const std::vector<ArchSpec>& recurrent_archs();

}  // namespace kvshare::refmodel::detail
