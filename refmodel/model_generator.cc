#include "refmodel/model_generator.h"

#include <fmt/format.h>

#include <cmath>
#include <random>

#include "refmodel/bpe_tokenizer.h"

namespace kvshare::refmodel {
namespace {

using layout::GgmlType;

// Byte tokens: printable ASCII, tab, newline and carriage return, so that every token
// (and so every reply a random model emits) decodes to valid UTF-8. Bytes outside this
// set have no token: llama.cpp's BPE drops them, as it does for any symbol without one.
std::vector<uint8_t> byte_token_bytes() {
  std::vector<uint8_t> bytes;
  for (int b = 0x21; b <= 0x7E; ++b) bytes.push_back(static_cast<uint8_t>(b));
  for (uint8_t b : {uint8_t{' '}, uint8_t{'\n'}, uint8_t{'\t'}, uint8_t{'\r'}}) bytes.push_back(b);
  return bytes;
}

// A few merges, in rank order, for the words ChatML prompts are made of. Written in
// vocabulary text (GPT-2 mapped: "Ġ" is a space, "Ċ" a newline). Each merge's parts are
// tokens by the time it applies, and its result becomes one.
const std::vector<std::pair<std::string, std::string>>& merge_pairs() {
  static const std::vector<std::pair<std::string, std::string>> merges = {
      {"Ġ", "t"}, {"h", "e"}, {"i", "n"}, {"e", "r"}, {"a", "n"}, {"o", "n"}, {"Ġ", "a"}, {"r", "e"},
      {"Ġt", "he"}, {"s", "t"}, {"e", "n"}, {"Ġ", "s"}, {"o", "u"}, {"Ġ", "w"}, {"Ċ", "Ċ"}, {"u", "s"},
      {"us", "er"}, {"a", "s"}, {"as", "s"}, {"i", "st"}, {"ass", "ist"}, {"an", "t"}, {"assist", "ant"},
      {"s", "y"}, {"sy", "st"}, {"e", "m"}, {"syst", "em"}, {"Ġ", "i"}, {"Ġi", "s"}, {"l", "l"}, {"e", "ll"},
      {"H", "ell"}, {"Hell", "o"},
  };
  return merges;
}

constexpr const char* kSpecials[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};

uint64_t fnv1a(std::string_view s, uint64_t seed) {
  uint64_t h = 0xcbf29ce484222325ull ^ seed;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// Uniform values in [-scale, scale] from a stream keyed by seed and tensor name, so
// adding a tensor does not change the others. Built from raw 64-bit draws: the same
// seed gives the same model with any standard library.
std::vector<float> random_values(uint64_t seed, const std::string& tensor, size_t n, float scale, float offset) {
  std::mt19937_64 rng(fnv1a(tensor, seed));
  std::vector<float> v(n);
  for (auto& x : v) x = offset + scale * static_cast<float>(static_cast<double>(rng() >> 11) * 0x1.0p-52 - 1.0);
  return v;
}

}  // namespace

std::vector<std::string> generated_vocabulary() {
  std::vector<std::string> tokens;
  for (uint8_t b : byte_token_bytes()) {
    const uint32_t cp = gpt2_byte_to_codepoint(b);
    std::string s;
    if (cp < 0x80) {
      s.push_back(static_cast<char>(cp));
    } else {
      s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    tokens.push_back(s);
  }
  for (const auto& [a, b] : merge_pairs()) tokens.push_back(a + b);
  for (const char* s : kSpecials) tokens.emplace_back(s);
  return tokens;
}

const std::string& generated_chat_template() {
  static const std::string t =
      "{%- for message in messages %}"
      "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
      "{%- endfor %}"
      "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";
  return t;
}

Result<void> validate(const GeneratorOptions& o) {
  if (o.arch != "qwen3" && o.arch != "qwen2" && o.arch != "llama")
    return fail(EINVAL, "--arch {}: not one of qwen3, qwen2, llama", o.arch);
  if (o.n_layer == 0 || o.n_embd == 0 || o.n_head == 0 || o.n_head_kv == 0 || o.head_dim == 0 || o.n_ff == 0 ||
      o.n_ctx_train == 0)
    return fail(EINVAL, "--layers, --embd, --heads, --heads-kv, --head-dim, --ff and --ctx must be positive");
  if (o.n_head % o.n_head_kv != 0)
    return fail(EINVAL, "--heads {} is not a multiple of --heads-kv {}", o.n_head, o.n_head_kv);
  if (o.head_dim % 2 != 0) return fail(EINVAL, "--head-dim {} must be even (RoPE rotates pairs)", o.head_dim);
  if (!(o.residual_gain > 0.0f) || !std::isfinite(o.residual_gain))
    return fail(EINVAL, "--residual-gain {}: must be a positive finite number", o.residual_gain);
  if (o.wtype != GgmlType::F32 && o.wtype != GgmlType::F16 && o.wtype != GgmlType::BF16 && o.wtype != GgmlType::Q8_0)
    return fail(EINVAL, "--wtype {}: not one of f32, f16, bf16, q8_0", layout::ggml_type_name(o.wtype));
  for (auto [what, n] : {std::pair{"--embd", o.n_embd}, std::pair{"--ff", o.n_ff},
                         std::pair{"--heads x --head-dim", o.n_head * o.head_dim}})
    if (!layout::is_row_aligned(o.wtype, n))
      return fail(EINVAL, "{} = {} is not a multiple of the {} block size {}", what, n,
                  layout::ggml_type_name(o.wtype), layout::ggml_traits(o.wtype).block_size);
  return {};
}

Result<layout::GgufWriter> make_model_writer(const GeneratorOptions& o) {
  auto ok = validate(o);
  if (!ok) return fail(ok.error());
  const std::string a = o.arch + ".";
  const std::vector<std::string> vocab = generated_vocabulary();
  const auto n_vocab = static_cast<int64_t>(vocab.size());
  const bool tied = o.tie_embeddings.value_or(o.arch == "qwen3");

  layout::GgufWriter w;
  w.add_string("general.architecture", o.arch);
  w.add_string("general.name", o.name.empty() ? "kvshare-tiny-" + o.arch : o.name);
  w.add_u32("general.file_type", o.wtype == GgmlType::F32 ? 0 : o.wtype == GgmlType::F16 ? 1 : o.wtype == GgmlType::Q8_0 ? 7 : 32);
  w.add_u32(a + "block_count", o.n_layer);
  w.add_u32(a + "context_length", o.n_ctx_train);
  w.add_u32(a + "embedding_length", o.n_embd);
  w.add_u32(a + "feed_forward_length", o.n_ff);
  w.add_u32(a + "attention.head_count", o.n_head);
  w.add_u32(a + "attention.head_count_kv", o.n_head_kv);
  w.add_u32(a + "attention.key_length", o.head_dim);
  w.add_u32(a + "attention.value_length", o.head_dim);
  w.add_u32(a + "rope.dimension_count", o.head_dim);
  w.add_f32(a + "attention.layer_norm_rms_epsilon", 1e-6f);
  w.add_f32(a + "rope.freq_base", o.arch == "llama" ? 10000.0f : 1000000.0f);

  std::vector<int32_t> types;
  for (const std::string& t : vocab) {
    bool special = false;
    for (const char* s : kSpecials) special = special || t == s;
    types.push_back(special ? 3 : 1);  // CONTROL : NORMAL
  }
  std::vector<std::string> merges;
  for (const auto& [l, r] : merge_pairs()) merges.push_back(l + " " + r);
  auto id_of = [&](std::string_view t) {
    for (size_t i = 0; i < vocab.size(); ++i)
      if (vocab[i] == t) return static_cast<uint32_t>(i);
    return 0u;
  };
  w.add_string("tokenizer.ggml.model", "gpt2");
  w.add_string("tokenizer.ggml.pre", "qwen2");
  w.add_string_array("tokenizer.ggml.tokens", vocab);
  w.add_i32_array("tokenizer.ggml.token_type", types);
  w.add_string_array("tokenizer.ggml.merges", merges);
  w.add_u32("tokenizer.ggml.bos_token_id", id_of("<|endoftext|>"));
  w.add_u32("tokenizer.ggml.eos_token_id", id_of("<|im_end|>"));
  w.add_u32("tokenizer.ggml.padding_token_id", id_of("<|endoftext|>"));
  w.add_bool("tokenizer.ggml.add_bos_token", false);
  w.add_string("tokenizer.chat_template", generated_chat_template());

  // Scales: embeddings of unit size (tied logits then have a wide margin, so a greedy
  // reply does not hinge on rounding), projections ~1/sqrt(fan-in) so the residual
  // stream stays O(1), norm weights near 1.
  auto add = [&](const std::string& name, std::vector<int64_t> ne, float scale, float offset, bool is_vector) -> Result<void> {
    const GgmlType type = is_vector ? GgmlType::F32 : o.wtype;
    if (o.shape_only) return w.add_tensor_shape(name, type, ne);
    size_t n = 1;
    for (int64_t d : ne) n *= static_cast<size_t>(d);
    const uint64_t seed = o.seed;
    return w.add_tensor_generated(name, type, ne, [=](std::span<std::byte> out) -> Result<void> {
      auto bytes = layout::encode_f32_as(type, random_values(seed, name, n, scale, offset));
      if (!bytes) return fail(bytes.error());
      if (bytes->size() != out.size())
        return fail(EINVAL, "tensor {}: encoded {} bytes, expected {}", name, bytes->size(), out.size());
      std::copy(bytes->begin(), bytes->end(), out.begin());
      return {};
    });
  };
  const int64_t E = o.n_embd, F = o.n_ff, HD = o.head_dim;
  const int64_t nq = o.n_head * HD, nkv = o.n_head_kv * HD;
  const float sqrt3 = std::sqrt(3.0f);
  auto proj = [&](int64_t fan_in) { return sqrt3 / std::sqrt(static_cast<float>(fan_in)); };
  std::vector<Result<void>> results;
  results.push_back(add("token_embd.weight", {E, n_vocab}, sqrt3, 0.0f, false));
  results.push_back(add("output_norm.weight", {E}, 0.1f, 1.0f, true));
  if (!tied) results.push_back(add("output.weight", {E, n_vocab}, 4.0f * proj(E), 0.0f, false));
  for (uint32_t il = 0; il < o.n_layer; ++il) {
    const std::string p = fmt::format("blk.{}.", il);
    results.push_back(add(p + "attn_norm.weight", {E}, 0.1f, 1.0f, true));
    results.push_back(add(p + "attn_q.weight", {E, nq}, proj(E), 0.0f, false));
    results.push_back(add(p + "attn_k.weight", {E, nkv}, proj(E), 0.0f, false));
    results.push_back(add(p + "attn_v.weight", {E, nkv}, proj(E), 0.0f, false));
    if (o.arch == "qwen2") {
      results.push_back(add(p + "attn_q.bias", {nq}, 0.1f, 0.0f, true));
      results.push_back(add(p + "attn_k.bias", {nkv}, 0.1f, 0.0f, true));
      results.push_back(add(p + "attn_v.bias", {nkv}, 0.1f, 0.0f, true));
    }
    results.push_back(add(p + "attn_output.weight", {nq, E}, o.residual_gain * proj(nq), 0.0f, false));
    if (o.arch == "qwen3") {
      results.push_back(add(p + "attn_q_norm.weight", {HD}, 0.1f, 1.0f, true));
      results.push_back(add(p + "attn_k_norm.weight", {HD}, 0.1f, 1.0f, true));
    }
    results.push_back(add(p + "ffn_norm.weight", {E}, 0.1f, 1.0f, true));
    results.push_back(add(p + "ffn_gate.weight", {E, F}, proj(E), 0.0f, false));
    results.push_back(add(p + "ffn_up.weight", {E, F}, proj(E), 0.0f, false));
    results.push_back(add(p + "ffn_down.weight", {F, E}, o.residual_gain * proj(F), 0.0f, false));
  }
  for (auto& r : results)
    if (!r) return fail(r.error().with_context("generating the model"));
  return w;
}

Result<void> generate_model(const GeneratorOptions& options, const layout::GgufSink& sink) {
  auto w = make_model_writer(options);
  if (!w) return fail(w.error());
  return w->write(sink, options.shape_only ? layout::GgufPayload::kMetaOnly : layout::GgufPayload::kWithData);
}

Result<std::vector<std::byte>> generate_model_bytes(const GeneratorOptions& options) {
  auto w = make_model_writer(options);
  if (!w) return fail(w.error());
  return w->finish(options.shape_only ? layout::GgufPayload::kMetaOnly : layout::GgufPayload::kWithData);
}

}  // namespace kvshare::refmodel
