// Archs with recurrent memory: mamba2 (llama_memory_recurrent over every layer), lfm2
// (short-conv layers + attention layers) and qwen35 (Gated DeltaNet layers + gated
// attention layers with M-RoPE), the last two llama_memory_hybrid.
//
// Their lm head is untied and the rows of the control tokens are 0: without that a
// random model's greedy reply can stop at <|im_end|> within a few tokens.
#include <fmt/format.h>

#include "refmodel/generator_parts.h"

namespace kvshare::refmodel::detail {
namespace {

// qwen35's M-RoPE sections (temporal, height, width, extra): text uses the first; they
// cover 2 * 16 = 32 rotated dimensions of each head (rope.dimension_count).
constexpr uint32_t kQwen35RopeSections[4] = {6, 5, 5, 0};
constexpr uint32_t kQwen35RopeDims = 2 * (6 + 5 + 5 + 0);

// mamba2's expand factor: d_inner = 2 * n_embd, as in the released Mamba-2 models.
uint32_t mamba2_d_inner(const GeneratorOptions& o) { return 2 * o.n_embd; }
// qwen35's GDN: d_inner = value heads x head size (the graph reads head_v_dim back as
// d_inner / time_step_rank).
uint32_t gdn_value_dim(const GeneratorOptions& o) { return o.ssm_n_head * o.ssm_d_state; }

Result<void> check_conv_kernel(const GeneratorOptions& o) {
  if (o.ssm_d_conv < 2)
    return fail(EINVAL, "--conv-kernel {}: the {} conv state keeps kernel - 1 columns, so it must be at least 2",
                o.ssm_d_conv, o.arch);
  return {};
}

// Both kinds of layer must be there, or llama.cpp builds another kind of memory.
Result<void> check_hybrid_layers(const Resolved& r) {
  if (r.attn_every < 2)
    return fail(EINVAL, "--attn-every {}: a {} model needs recurrent layers, so at most every 2nd layer is attention",
                r.attn_every, r.o.arch);
  if (r.n_layer < r.attn_every)
    return fail(EINVAL,
                "--layers {} with --attn-every {}: a {} model needs an attention layer (layer il is one "
                "when (il + 1) % {} == 0)",
                r.n_layer, r.attn_every, r.o.arch, r.attn_every);
  return {};
}

Result<void> check_mamba2(const Resolved& r) {
  const GeneratorOptions& o = r.o;
  const uint32_t d_inner = mamba2_d_inner(o);
  if (d_inner % o.ssm_n_head != 0)
    return fail(EINVAL, "--ssm-heads {} does not divide mamba2's d_inner {} (2 x --embd)", o.ssm_n_head, d_inner);
  if (d_inner % r.ssm_n_group != 0)
    return fail(EINVAL, "--ssm-groups {} does not divide mamba2's d_inner {} (2 x --embd)", r.ssm_n_group, d_inner);
  if (auto ok = check_conv_kernel(o); !ok) return ok;
  return check_rows(o, {{"--embd", o.n_embd}, {"d_inner (2 x --embd)", d_inner}});
}

Result<void> check_lfm2(const Resolved& r) {
  const GeneratorOptions& o = r.o;
  if (o.n_embd % o.n_head != 0)
    return fail(EINVAL, "--embd {} is not a multiple of --heads {} (lfm2's head size is embd / heads)", o.n_embd,
                o.n_head);
  if (o.n_head % o.n_head_kv != 0)
    return fail(EINVAL, "--heads {} is not a multiple of --heads-kv {}", o.n_head, o.n_head_kv);
  if ((o.n_embd / o.n_head) % 2 != 0)
    return fail(EINVAL, "--embd / --heads = {} must be even (lfm2's head size; RoPE rotates pairs)",
                o.n_embd / o.n_head);
  if (auto ok = check_hybrid_layers(r); !ok) return ok;
  if (auto ok = check_conv_kernel(o); !ok) return ok;
  return check_rows(o, {{"--embd", o.n_embd}, {"--ff", o.n_ff}});
}

Result<void> check_qwen35(const Resolved& r) {
  const GeneratorOptions& o = r.o;
  if (o.n_head % o.n_head_kv != 0)
    return fail(EINVAL, "--heads {} is not a multiple of --heads-kv {}", o.n_head, o.n_head_kv);
  if (o.head_dim % 2 != 0 || o.head_dim < kQwen35RopeDims)
    return fail(EINVAL,
                "--head-dim {}: qwen35 needs an even head size of at least {} (M-RoPE sections 6,5,5,0 "
                "rotate {} dimensions)",
                o.head_dim, kQwen35RopeDims, kQwen35RopeDims);
  if (o.ssm_n_head % r.ssm_n_group != 0)
    return fail(EINVAL, "--ssm-heads {} (GDN value heads) is not a multiple of --ssm-groups {} (GDN key heads)",
                o.ssm_n_head, r.ssm_n_group);
  if (auto ok = check_hybrid_layers(r); !ok) return ok;
  if (auto ok = check_conv_kernel(o); !ok) return ok;
  return check_rows(o, {{"--embd", o.n_embd},
                        {"--ff", o.n_ff},
                        {"--heads x --head-dim", int64_t{o.n_head} * o.head_dim},
                        {"--ssm-heads x --ssm-state", gdn_value_dim(o)}});
}

// src/models/mamba2.cpp load_arch_hparams: every ssm key is required; no attention keys.
void write_mamba2_keys(layout::GgufWriter& w, const Resolved& r) {
  const GeneratorOptions& o = r.o;
  w.add_u32("mamba2.ssm.conv_kernel", o.ssm_d_conv);
  w.add_u32("mamba2.ssm.inner_size", mamba2_d_inner(o));
  w.add_u32("mamba2.ssm.state_size", o.ssm_d_state);
  w.add_u32("mamba2.ssm.time_step_rank", o.ssm_n_head);
  w.add_u32("mamba2.ssm.group_count", r.ssm_n_group);
  w.add_f32("mamba2.attention.layer_norm_rms_epsilon", 1e-5f);
}

// src/models/lfm2.cpp load_arch_hparams: a layer is a conv layer iff its head_count_kv
// is 0. No sliding_window: with one the memory would be hybrid_iswa.
void write_lfm2_keys(layout::GgufWriter& w, const Resolved& r) {
  const GeneratorOptions& o = r.o;
  std::vector<uint32_t> n_head_kv(r.n_layer);
  for (uint32_t il = 0; il < r.n_layer; ++il) n_head_kv[il] = r.is_attention(il) ? o.n_head_kv : 0;
  w.add_u32("lfm2.feed_forward_length", o.n_ff);
  w.add_u32("lfm2.attention.head_count", o.n_head);
  w.add_u32_array("lfm2.attention.head_count_kv", n_head_kv);
  w.add_u32("lfm2.shortconv.l_cache", o.ssm_d_conv);
  w.add_f32("lfm2.attention.layer_norm_rms_epsilon", 1e-5f);
  w.add_f32("lfm2.rope.freq_base", 1000000.0f);
}

// src/models/qwen35.cpp load_arch_hparams: the ssm keys describe the GDN layers
// (group_count = key heads, time_step_rank = value heads), full_attention_interval
// which layers are attention.
void write_qwen35_keys(layout::GgufWriter& w, const Resolved& r) {
  const GeneratorOptions& o = r.o;
  w.add_u32("qwen35.feed_forward_length", o.n_ff);
  w.add_u32("qwen35.attention.head_count", o.n_head);
  w.add_u32("qwen35.attention.head_count_kv", o.n_head_kv);
  w.add_u32("qwen35.attention.key_length", o.head_dim);
  w.add_u32("qwen35.attention.value_length", o.head_dim);
  w.add_u32("qwen35.rope.dimension_count", kQwen35RopeDims);
  w.add_u32_array("qwen35.rope.dimension_sections",
                  std::vector<uint32_t>(std::begin(kQwen35RopeSections), std::end(kQwen35RopeSections)));
  w.add_f32("qwen35.rope.freq_base", 10000000.0f);
  w.add_f32("qwen35.attention.layer_norm_rms_epsilon", 1e-6f);
  w.add_u32("qwen35.ssm.conv_kernel", o.ssm_d_conv);
  w.add_u32("qwen35.ssm.inner_size", gdn_value_dim(o));
  w.add_u32("qwen35.ssm.state_size", o.ssm_d_state);
  w.add_u32("qwen35.ssm.time_step_rank", o.ssm_n_head);
  w.add_u32("qwen35.ssm.group_count", r.ssm_n_group);
  w.add_u32("qwen35.full_attention_interval", r.attn_every);
}

// Negative decay rates (-exp(A_log) in the checkpoints): a positive one makes the state
// grow without bound along the prompt.
constexpr Init kNegativeA{0.5f, -1.0f};

// src/models/mamba2.cpp load_arch_tensors: 9 tensors per layer.
void write_mamba2_tensors(TensorAdder& t, const Resolved& r) {
  const GeneratorOptions& o = r.o;
  const int64_t E = o.n_embd, d_inner = mamba2_d_inner(o), n_head = o.ssm_n_head, n_group = r.ssm_n_group;
  const int64_t conv_dim = d_inner + 2 * n_group * o.ssm_d_state;
  const int64_t d_in_proj = d_inner + conv_dim + n_head;  // z, xBC, dt
  t.token_embd();
  t.norm("output_norm.weight", E);
  t.output(true);
  for (uint32_t il = 0; il < r.n_layer; ++il) {
    const std::string p = fmt::format("blk.{}.", il);
    t.norm(p + "attn_norm.weight", E);
    t.weight(p + "ssm_in.weight", E, d_in_proj, t.proj(E));
    t.f32(p + "ssm_conv1d.weight", {o.ssm_d_conv, conv_dim}, {t.proj(o.ssm_d_conv)});
    t.f32(p + "ssm_conv1d.bias", {conv_dim}, {0.1f});
    t.f32(p + "ssm_dt.bias", {n_head}, {0.5f});
    t.f32(p + "ssm_a", {1, n_head}, kNegativeA);
    t.f32(p + "ssm_d", {1, n_head}, kNorm);
    t.f32(p + "ssm_norm.weight", {d_inner / n_group, n_group}, kNorm);
    t.weight(p + "ssm_out.weight", d_inner, E, t.residual(d_inner));
  }
}

// src/models/lfm2.cpp load_arch_tensors: 8 tensors per conv layer, 11 per attention
// layer; the output norm is named token_embd_norm (LLM_TENSOR_OUTPUT_NORM_LFM2).
void write_lfm2_tensors(TensorAdder& t, const Resolved& r) {
  const GeneratorOptions& o = r.o;
  const int64_t E = o.n_embd, head_dim = o.n_embd / o.n_head, nkv = int64_t{o.n_head_kv} * head_dim;
  t.token_embd();
  t.norm("token_embd_norm.weight", E);
  t.output(true);
  for (uint32_t il = 0; il < r.n_layer; ++il) {
    const std::string p = fmt::format("blk.{}.", il);
    t.norm(p + "attn_norm.weight", E);
    if (r.is_attention(il)) {
      t.norm(p + "attn_q_norm.weight", head_dim);
      t.norm(p + "attn_k_norm.weight", head_dim);
      t.weight(p + "attn_q.weight", E, E, t.proj(E));
      t.weight(p + "attn_k.weight", E, nkv, t.proj(E));
      t.weight(p + "attn_v.weight", E, nkv, t.proj(E));
      t.weight(p + "attn_output.weight", E, E, t.residual(E));
    } else {
      t.f32(p + "shortconv.conv.weight", {o.ssm_d_conv, E}, {t.proj(o.ssm_d_conv)});
      t.weight(p + "shortconv.in_proj.weight", E, 3 * E, t.proj(E));
      t.weight(p + "shortconv.out_proj.weight", E, E, t.residual(E));
    }
    t.norm(p + "ffn_norm.weight", E);
    t.swiglu_ffn(p);
  }
}

// src/models/qwen35.cpp load_arch_tensors (load_block_trunk): 11 tensors per attention
// layer (attn_q holds query and gate, hence 2 x), 14 per GDN layer. Every layer has
// post_attention_norm as its FFN's input norm and no ffn_norm.
void write_qwen35_tensors(TensorAdder& t, const Resolved& r) {
  const GeneratorOptions& o = r.o;
  const int64_t E = o.n_embd, HD = o.head_dim, nq = o.n_head * HD, nkv = o.n_head_kv * HD;
  const int64_t key_dim = int64_t{r.ssm_n_group} * o.ssm_d_state, value_dim = gdn_value_dim(o);
  const int64_t n_v_heads = o.ssm_n_head;
  t.token_embd();
  t.norm("output_norm.weight", E);
  t.output(true);
  for (uint32_t il = 0; il < r.n_layer; ++il) {
    const std::string p = fmt::format("blk.{}.", il);
    t.norm(p + "attn_norm.weight", E);
    t.norm(p + "post_attention_norm.weight", E);
    if (r.is_attention(il)) {
      t.weight(p + "attn_q.weight", E, 2 * nq, t.proj(E));
      t.weight(p + "attn_k.weight", E, nkv, t.proj(E));
      t.weight(p + "attn_v.weight", E, nkv, t.proj(E));
      t.weight(p + "attn_output.weight", nq, E, t.residual(nq));
      t.norm(p + "attn_q_norm.weight", HD);
      t.norm(p + "attn_k_norm.weight", HD);
    } else {
      t.weight(p + "attn_qkv.weight", E, 2 * key_dim + value_dim, t.proj(E));
      t.weight(p + "attn_gate.weight", E, value_dim, t.proj(E));
      t.f32(p + "ssm_conv1d.weight", {o.ssm_d_conv, 2 * key_dim + value_dim}, {t.proj(o.ssm_d_conv)});
      t.f32(p + "ssm_dt.bias", {n_v_heads}, {0.5f});
      t.f32(p + "ssm_a", {n_v_heads}, kNegativeA);
      t.weight(p + "ssm_beta.weight", E, n_v_heads, t.proj(E));
      t.weight(p + "ssm_alpha.weight", E, n_v_heads, t.proj(E));
      t.norm(p + "ssm_norm.weight", o.ssm_d_state);
      t.weight(p + "ssm_out.weight", value_dim, E, t.residual(value_dim));
    }
    t.swiglu_ffn(p);
  }
}

}  // namespace

const std::vector<ArchSpec>& recurrent_archs() {
  static const std::vector<ArchSpec> specs{
      {"mamba2", 2, 1, 0, false, check_mamba2, write_mamba2_keys, write_mamba2_tensors},
      {"lfm2", 2, 0, 2, false, check_lfm2, write_lfm2_keys, write_lfm2_tensors},
      {"qwen35", 4, 2, 4, false, check_qwen35, write_qwen35_keys, write_qwen35_tensors},
  };
  return specs;
}

}  // namespace kvshare::refmodel::detail
