#include "refmodel/model_generator.h"

#include <fmt/format.h>

#include <cmath>

#include "refmodel/bpe_tokenizer.h"
#include "refmodel/generator_parts.h"

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
      {"Ġ", "t"},  {"h", "e"},        {"i", "n"},   {"e", "r"},   {"a", "n"},    {"o", "n"},     {"Ġ", "a"},
      {"r", "e"},  {"Ġt", "he"},      {"s", "t"},   {"e", "n"},   {"Ġ", "s"},    {"o", "u"},     {"Ġ", "w"},
      {"Ċ", "Ċ"},  {"u", "s"},        {"us", "er"}, {"a", "s"},   {"as", "s"},   {"i", "st"},    {"ass", "ist"},
      {"an", "t"}, {"assist", "ant"}, {"s", "y"},   {"sy", "st"}, {"e", "m"},    {"syst", "em"}, {"Ġ", "i"},
      {"Ġi", "s"}, {"l", "l"},        {"e", "ll"},  {"H", "ell"}, {"Hell", "o"},
  };
  return merges;
}

constexpr const char* kSpecials[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};

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

namespace {

using detail::ArchSpec;
using detail::Resolved;

const ArchSpec* find_arch(const std::string& name) {
  for (const auto* family : {&detail::transformer_archs(), &detail::recurrent_archs()})
    for (const ArchSpec& spec : *family)
      if (name == spec.name) return &spec;
  return nullptr;
}

Resolved resolve(const GeneratorOptions& o, const ArchSpec& spec) {
  return {o, o.n_layer.value_or(spec.default_layers), o.ssm_n_group.value_or(spec.default_ssm_n_group),
          o.attn_every.value_or(spec.default_attn_every)};
}

uint32_t file_type(GgmlType wtype) {
  return wtype == GgmlType::F32 ? 0 : wtype == GgmlType::F16 ? 1 : wtype == GgmlType::Q8_0 ? 7 : 32;
}

// The tokenizer keys every generated model carries (docs/refmodel.md, "kvshare-mkmodel").
void write_tokenizer(layout::GgufWriter& w, const std::vector<std::string>& vocab) {
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
}

std::vector<int64_t> control_token_ids(const std::vector<std::string>& vocab) {
  std::vector<int64_t> ids;
  for (size_t i = 0; i < vocab.size(); ++i)
    for (const char* s : kSpecials)
      if (vocab[i] == s) ids.push_back(static_cast<int64_t>(i));
  return ids;
}

}  // namespace

const std::vector<std::string>& generator_archs() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const auto* family : {&detail::transformer_archs(), &detail::recurrent_archs()})
      for (const ArchSpec& spec : *family) out.emplace_back(spec.name);
    return out;
  }();
  return names;
}

Result<void> validate(const GeneratorOptions& o) {
  const ArchSpec* spec = find_arch(o.arch);
  if (spec == nullptr) return fail(EINVAL, "--arch {}: not one of {}", o.arch, fmt::join(generator_archs(), ", "));
  const Resolved r = resolve(o, *spec);
  for (auto [what, n] :
       {std::pair{"--layers", r.n_layer}, std::pair{"--embd", o.n_embd}, std::pair{"--heads", o.n_head},
        std::pair{"--heads-kv", o.n_head_kv}, std::pair{"--head-dim", o.head_dim}, std::pair{"--ff", o.n_ff},
        std::pair{"--ctx", o.n_ctx_train}, std::pair{"--conv-kernel", o.ssm_d_conv},
        std::pair{"--ssm-state", o.ssm_d_state}, std::pair{"--ssm-heads", o.ssm_n_head}})
    if (n == 0) return fail(EINVAL, "{} is 0: it must be positive", what);
  if (o.ssm_n_group == 0u) return fail(EINVAL, "--ssm-groups is 0: it must be positive");
  if (!(o.residual_gain > 0.0f) || !std::isfinite(o.residual_gain))
    return fail(EINVAL, "--residual-gain {}: must be a positive finite number", o.residual_gain);
  if (o.wtype != GgmlType::F32 && o.wtype != GgmlType::F16 && o.wtype != GgmlType::BF16 && o.wtype != GgmlType::Q8_0)
    return fail(EINVAL, "--wtype {}: not one of f32, f16, bf16, q8_0", layout::ggml_type_name(o.wtype));
  return spec->check(r);
}

Result<layout::GgufWriter> make_model_writer(const GeneratorOptions& o) {
  auto ok = validate(o);
  if (!ok) return fail(ok.error());
  const ArchSpec& spec = *find_arch(o.arch);
  const Resolved r = resolve(o, spec);
  const std::vector<std::string> vocab = generated_vocabulary();
  const std::string a = o.arch + ".";

  layout::GgufWriter w;
  w.add_string("general.architecture", o.arch);
  w.add_string("general.name", o.name.empty() ? "kvshare-tiny-" + o.arch : o.name);
  w.add_u32("general.file_type", file_type(o.wtype));
  w.add_u32(a + "block_count", r.n_layer);
  w.add_u32(a + "context_length", o.n_ctx_train);
  w.add_u32(a + "embedding_length", o.n_embd);
  spec.write_keys(w, r);
  write_tokenizer(w, vocab);

  detail::TensorAdder adder(w, o, static_cast<int64_t>(vocab.size()), control_token_ids(vocab),
                            o.tie_embeddings.value_or(spec.tied_by_default));
  spec.write_tensors(adder, r);
  if (auto status = adder.status(); !status) return fail(status.error().with_context("generating the model"));
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
