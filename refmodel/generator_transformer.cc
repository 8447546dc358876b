// Attention-only archs: llama, qwen2, qwen3 (one llama_kv_cache) and gemma3 (iSWA:
// llama_kv_cache_iswa, a base cache for the full layers and a SWA cache for the others).
#include <fmt/format.h>

#include <cmath>

#include "refmodel/generator_parts.h"

namespace kvshare::refmodel::detail {
namespace {

Result<void> check_heads(const GeneratorOptions& o) {
  if (o.n_head % o.n_head_kv != 0)
    return fail(EINVAL, "--heads {} is not a multiple of --heads-kv {}", o.n_head, o.n_head_kv);
  if (o.head_dim % 2 != 0) return fail(EINVAL, "--head-dim {} must be even (RoPE rotates pairs)", o.head_dim);
  return check_rows(o,
                    {{"--embd", o.n_embd}, {"--ff", o.n_ff}, {"--heads x --head-dim", int64_t{o.n_head} * o.head_dim}});
}

Result<void> check_dense(const Resolved& r) { return check_heads(r.o); }

Result<void> check_gemma3(const Resolved& r) {
  if (r.o.n_swa == 0)
    return fail(EINVAL, "--swa-window 0: gemma3 is the iSWA model, its sliding window must be at least 1 token");
  return check_heads(r.o);
}

// The head keys every attention arch here writes, in the order the first generator wrote them.
void write_attention_keys(layout::GgufWriter& w, const std::string& a, const GeneratorOptions& o) {
  w.add_u32(a + "feed_forward_length", o.n_ff);
  w.add_u32(a + "attention.head_count", o.n_head);
  w.add_u32(a + "attention.head_count_kv", o.n_head_kv);
  w.add_u32(a + "attention.key_length", o.head_dim);
  w.add_u32(a + "attention.value_length", o.head_dim);
  w.add_u32(a + "rope.dimension_count", o.head_dim);
  w.add_f32(a + "attention.layer_norm_rms_epsilon", 1e-6f);
}

void write_dense_keys(layout::GgufWriter& w, const Resolved& r) {
  const std::string a = r.o.arch + ".";
  write_attention_keys(w, a, r.o);
  w.add_f32(a + "rope.freq_base", r.o.arch == "llama" ? 10000.0f : 1000000.0f);
}

// src/models/gemma3.cpp load_arch_hparams: SWA only with a non-zero sliding_window; the
// pattern's period 2 makes layer il SWA when il % 2 == 0 (its default, 6, would leave a
// 2-layer model without a full-attention layer).
void write_gemma3_keys(layout::GgufWriter& w, const Resolved& r) {
  const std::string a = "gemma3.";
  write_attention_keys(w, a, r.o);
  w.add_f32(a + "rope.freq_base", 1000000.0f);
  w.add_f32(a + "rope.freq_base_swa", 10000.0f);
  w.add_u32(a + "attention.sliding_window", r.o.n_swa);
  w.add_u32(a + "attention.sliding_window_pattern", 2);
}

void write_dense_tensors(TensorAdder& t, const Resolved& r) {
  const GeneratorOptions& o = r.o;
  const int64_t E = o.n_embd, HD = o.head_dim;
  const int64_t nq = o.n_head * HD, nkv = o.n_head_kv * HD;
  t.token_embd();
  t.norm("output_norm.weight", E);
  t.output();
  for (uint32_t il = 0; il < r.n_layer; ++il) {
    const std::string p = fmt::format("blk.{}.", il);
    t.norm(p + "attn_norm.weight", E);
    t.weight(p + "attn_q.weight", E, nq, t.proj(E));
    t.weight(p + "attn_k.weight", E, nkv, t.proj(E));
    t.weight(p + "attn_v.weight", E, nkv, t.proj(E));
    if (o.arch == "qwen2") {
      t.f32(p + "attn_q.bias", {nq}, {0.1f});
      t.f32(p + "attn_k.bias", {nkv}, {0.1f});
      t.f32(p + "attn_v.bias", {nkv}, {0.1f});
    }
    t.weight(p + "attn_output.weight", nq, E, t.residual(nq));
    if (o.arch == "qwen3") {
      t.norm(p + "attn_q_norm.weight", HD);
      t.norm(p + "attn_k_norm.weight", HD);
    }
    t.norm(p + "ffn_norm.weight", E);
    t.swiglu_ffn(p);
  }
}

// src/models/gemma3.cpp load_arch_tensors: 13 tensors per layer. The block's outputs pass
// through post_attention_norm and post_ffw_norm before the residual add, so those norms'
// weights (not attn_output or ffn_down) set how much a layer writes into a stream that
// starts at the embedding times sqrt(n_embd): at gain 1 a block writes as much as that
// embedding holds and the tied head still echoes the last token; at 3 the reply depends on
// the prompt, as for qwen3.
void write_gemma3_tensors(TensorAdder& t, const Resolved& r) {
  const GeneratorOptions& o = r.o;
  const int64_t E = o.n_embd, HD = o.head_dim;
  const int64_t nq = o.n_head * HD, nkv = o.n_head_kv * HD;
  const float post_gain = o.residual_gain * std::sqrt(static_cast<float>(E));
  const Init post_norm{0.1f * post_gain, post_gain};
  t.token_embd();
  t.norm("output_norm.weight", E);
  t.output();
  for (uint32_t il = 0; il < r.n_layer; ++il) {
    const std::string p = fmt::format("blk.{}.", il);
    t.norm(p + "attn_norm.weight", E);
    t.weight(p + "attn_q.weight", E, nq, t.proj(E));
    t.weight(p + "attn_k.weight", E, nkv, t.proj(E));
    t.weight(p + "attn_v.weight", E, nkv, t.proj(E));
    t.weight(p + "attn_output.weight", nq, E, t.proj(nq));
    t.f32(p + "post_attention_norm.weight", {E}, post_norm);
    t.norm(p + "attn_k_norm.weight", HD);
    t.norm(p + "attn_q_norm.weight", HD);
    t.norm(p + "ffn_norm.weight", E);
    t.weight(p + "ffn_gate.weight", E, o.n_ff, t.proj(E));
    t.weight(p + "ffn_up.weight", E, o.n_ff, t.proj(E));
    t.weight(p + "ffn_down.weight", o.n_ff, E, t.proj(o.n_ff));
    t.f32(p + "post_ffw_norm.weight", {E}, post_norm);
  }
}

}  // namespace

const std::vector<ArchSpec>& transformer_archs() {
  static const std::vector<ArchSpec> specs{
      {"qwen3", 2, 0, 0, true, check_dense, write_dense_keys, write_dense_tensors},
      {"qwen2", 2, 0, 0, false, check_dense, write_dense_keys, write_dense_tensors},
      {"llama", 2, 0, 0, false, check_dense, write_dense_keys, write_dense_tensors},
      {"gemma3", 2, 0, 0, true, check_gemma3, write_gemma3_keys, write_gemma3_tensors},
  };
  return specs;
}

}  // namespace kvshare::refmodel::detail
