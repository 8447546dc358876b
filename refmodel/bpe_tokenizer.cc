#include "refmodel/bpe_tokenizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <unordered_map>

namespace kvshare::refmodel {
namespace {

// llama_token_type values of tokenizer.ggml.token_type.
enum TokenType : int32_t { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

std::string codepoint_to_utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    s.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return s;
}

// Unicode flags of an ASCII code point as llama.cpp's unicode_cpt_flags_from_cpt sees
// them: letters, digits, whitespace (\t..\r and space), and everything else (controls,
// punctuation, symbols) as "some other category" (non-zero flags).
struct AsciiFlags {
  bool in_range = false;
  bool is_letter = false;
  bool is_number = false;
  bool is_whitespace = false;
  bool any() const { return in_range; }
};

AsciiFlags flags_of(std::string_view t, size_t pos) {
  AsciiFlags f;
  if (pos >= t.size()) return f;
  const char c = t[pos];
  f.in_range = true;
  f.is_letter = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
  f.is_number = c >= '0' && c <= '9';
  f.is_whitespace = (c >= '\t' && c <= '\r') || c == ' ';
  return f;
}

constexpr uint32_t kOutOfRange = 0xFFFFFFFF;
uint32_t cpt_of(std::string_view t, size_t pos) { return pos < t.size() ? static_cast<uint8_t>(t[pos]) : kOutOfRange; }
uint32_t lower(uint32_t c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }

}  // namespace

uint32_t gpt2_byte_to_codepoint(uint8_t b) {
  // bytes_to_unicode: printable Latin-1 keeps its code point; the other 68 bytes take
  // 256, 257, ... in byte order.
  auto printable = [](int x) {
    return (x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF);
  };
  if (printable(b)) return b;
  uint32_t n = 0;
  for (int x = 0; x < b; ++x)
    if (!printable(x)) ++n;
  return 256 + n;
}

std::vector<std::string> pre_tokenize_ascii(std::string_view t, bool qwen2_rules) {
  std::vector<std::string> words;
  size_t prev_end = 0;
  auto add_token = [&](size_t end) -> size_t {
    const size_t len = end - prev_end;
    if (len > 0) words.emplace_back(t.substr(prev_end, len));
    prev_end = end;
    return len;
  };
  const size_t end = t.size();
  for (size_t pos = 0; pos < end;) {
    const uint32_t cpt = cpt_of(t, pos);
    const AsciiFlags flags = flags_of(t, pos);
    // 's|'t|'re|'ve|'m|'ll|'d (qwen2: case-insensitive)
    if (cpt == '\'' && pos + 1 < end) {
      const uint32_t next = qwen2_rules ? lower(cpt_of(t, pos + 1)) : cpt_of(t, pos + 1);
      if (next == 's' || next == 't' || next == 'm' || next == 'd') {
        pos += add_token(pos + 2);
        continue;
      }
      if (pos + 2 < end) {
        const uint32_t next2 = qwen2_rules ? lower(cpt_of(t, pos + 2)) : cpt_of(t, pos + 2);
        if ((next == 'r' && next2 == 'e') || (next == 'v' && next2 == 'e') || (next == 'l' && next2 == 'l')) {
          pos += add_token(pos + 3);
          continue;
        }
      }
    }
    if (qwen2_rules) {
      // [^\r\n\p{L}\p{N}]?\p{L}+
      if (!(cpt == '\r' || cpt == '\n' || flags.is_number)) {
        if (flags.is_letter || flags_of(t, pos + 1).is_letter) {
          pos++;
          while (flags_of(t, pos).is_letter) pos++;
          add_token(pos);
          continue;
        }
      }
      // \p{N}
      if (flags.is_number) {
        pos++;
        add_token(pos);
        continue;
      }
      // <space>?[^\s\p{L}\p{N}]+[\r\n]*  (llama.cpp tests `flags`, not `flags2`, for the
      // first character: kept as it is)
      AsciiFlags flags2 = cpt == ' ' ? flags_of(t, pos + 1) : flags;
      if (!(flags2.is_whitespace || flags2.is_letter || flags2.is_number) && flags.any()) {
        pos += (cpt == ' ');
        while (!(flags2.is_whitespace || flags2.is_letter || flags2.is_number) && flags2.any())
          flags2 = flags_of(t, ++pos);
        uint32_t cpt2 = cpt_of(t, pos);
        while (cpt2 == '\r' || cpt2 == '\n') cpt2 = cpt_of(t, ++pos);
        add_token(pos);
        continue;
      }
      size_t num_whitespaces = 0;
      size_t last_end_r_or_n = 0;
      while (flags_of(t, pos + num_whitespaces).is_whitespace) {
        const uint32_t cpt2 = cpt_of(t, pos + num_whitespaces);
        if (cpt2 == '\r' || cpt2 == '\n') last_end_r_or_n = pos + num_whitespaces + 1;
        num_whitespaces++;
      }
      // \s*[\r\n]+
      if (last_end_r_or_n > 0) {
        pos = last_end_r_or_n;
        add_token(pos);
        continue;
      }
      // \s+(?!\S)
      if (num_whitespaces > 1 && cpt_of(t, pos + num_whitespaces) != kOutOfRange) {
        pos += num_whitespaces - 1;
        add_token(pos);
        continue;
      }
      // \s+
      if (num_whitespaces > 0) {
        pos += num_whitespaces;
        add_token(pos);
        continue;
      }
    } else {
      AsciiFlags flags2 = cpt == ' ' ? flags_of(t, pos + 1) : flags;
      // <space>?\p{L}+
      if (flags2.is_letter) {
        pos += (cpt == ' ');
        while (flags2.is_letter) flags2 = flags_of(t, ++pos);
        add_token(pos);
        continue;
      }
      // <space>?\p{N}+
      if (flags2.is_number) {
        pos += (cpt == ' ');
        while (flags2.is_number) flags2 = flags_of(t, ++pos);
        add_token(pos);
        continue;
      }
      // <space>?[^\s\p{L}\p{N}]+
      if (!(flags2.is_whitespace || flags2.is_letter || flags2.is_number) && flags2.any()) {
        pos += (cpt == ' ');
        while (!(flags2.is_whitespace || flags2.is_letter || flags2.is_number) && flags2.any())
          flags2 = flags_of(t, ++pos);
        add_token(pos);
        continue;
      }
      size_t num_whitespaces = 0;
      while (flags_of(t, pos + num_whitespaces).is_whitespace) num_whitespaces++;
      // \s+(?!\S)
      if (num_whitespaces > 1 && cpt_of(t, pos + num_whitespaces) != kOutOfRange) {
        pos += num_whitespaces - 1;
        add_token(pos);
        continue;
      }
      // \s+
      if (num_whitespaces > 0) {
        pos += num_whitespaces;
        add_token(pos);
        continue;
      }
    }
    // no match
    add_token(++pos);
  }
  return words;
}

namespace {

class BpeTokenizer final : public Tokenizer {
 public:
  std::string name_;
  std::string model_;
  std::string pre_;
  bool supports_text_ = false;
  bool qwen2_rules_ = false;
  std::vector<std::string> tokens_;
  std::vector<int32_t> types_;
  std::unordered_map<std::string, int32_t> token_to_id_;
  std::unordered_map<std::string, int32_t> merge_rank_;  // "left right" -> rank
  std::vector<int32_t> specials_;                        // llama.cpp's cache_special_tokens order
  std::vector<std::string> byte_text_;                   // [256] mapped text of each byte
  std::unordered_map<uint32_t, uint8_t> codepoint_to_byte_;
  int32_t bos_ = -1, eos_ = -1, eot_ = -1;
  bool add_bos_ = false, add_eos_ = false;
  std::vector<int32_t> eog_;

  bool supports_text() const override { return supports_text_; }
  int32_t n_vocab() const override { return static_cast<int32_t>(tokens_.size()); }
  int32_t bos_id() const override { return bos_; }
  int32_t eos_id() const override { return eos_; }
  bool add_bos() const override { return add_bos_; }
  bool is_end_of_generation(int32_t id) const override { return std::find(eog_.begin(), eog_.end(), id) != eog_.end(); }

  Result<std::vector<int32_t>> tokenize(std::string_view text, bool add_special, bool parse_special) const override {
    if (!supports_text_)
      return fail(ENOTSUP,
                  "model {}: text tokenization is not supported for this vocabulary (tokenizer.ggml.model \"{}\", "
                  "tokenizer.ggml.pre \"{}\"); pass token ids instead",
                  name_, model_, pre_);
    for (size_t i = 0; i < text.size(); ++i)
      if (static_cast<unsigned char>(text[i]) >= 0x80)
        return fail(ENOTSUP,
                    "model {}: text has a non-ASCII byte 0x{:02x} at offset {}; the reference tokenizer matches "
                    "llama.cpp for ASCII text only; pass token ids instead",
                    name_, static_cast<unsigned char>(text[i]), i);

    // Fragments: {token id, or -1 with [begin, end) of raw text}. Mirrors
    // tokenizer_st_partition: each special (longest first) splits every raw fragment.
    struct Fragment {
      int32_t id;
      size_t begin, end;
    };
    std::vector<Fragment> fragments{{-1, 0, text.size()}};
    for (int32_t sid : specials_) {
      if (!parse_special && (types_[sid] == kControl || types_[sid] == kUnknown)) continue;
      const std::string& st = tokens_[sid];
      if (st.empty()) continue;
      std::vector<Fragment> next;
      for (const Fragment& f : fragments) {
        if (f.id >= 0) {
          next.push_back(f);
          continue;
        }
        size_t at = f.begin;
        while (true) {
          const size_t match = text.substr(0, f.end).find(st, at);
          if (match == std::string_view::npos) break;
          if (match > at) next.push_back({-1, at, match});
          next.push_back({sid, 0, 0});
          at = match + st.size();
        }
        if (at < f.end) next.push_back({-1, at, f.end});
      }
      fragments = std::move(next);
    }

    std::vector<int32_t> out;
    if (add_special && add_bos_ && bos_ >= 0) out.push_back(bos_);
    for (const Fragment& f : fragments) {
      if (f.id >= 0) {
        out.push_back(f.id);
        continue;
      }
      for (const std::string& word : pre_tokenize_ascii(text.substr(f.begin, f.end - f.begin), qwen2_rules_))
        bpe_word(word, out);
    }
    if (add_special && add_eos_ && eos_ >= 0) out.push_back(eos_);
    return out;
  }

  // llm_tokenizer_bpe_session::tokenize for one word: merges by rank (lowest first,
  // leftmost on ties), then each symbol's id; a symbol with no id falls back to the ids
  // of its single bytes, and bytes without one are dropped, as llama.cpp does.
  void bpe_word(const std::string& word, std::vector<int32_t>& out) const {
    std::vector<std::string> symbols;
    for (unsigned char c : word) symbols.push_back(byte_text_[c]);
    while (symbols.size() > 1) {
      int best_rank = -1;
      size_t best = 0;
      for (size_t i = 0; i + 1 < symbols.size(); ++i) {
        auto it = merge_rank_.find(symbols[i] + " " + symbols[i + 1]);
        if (it != merge_rank_.end() && (best_rank < 0 || it->second < best_rank)) {
          best_rank = it->second;
          best = i;
        }
      }
      if (best_rank < 0) break;
      symbols[best] += symbols[best + 1];
      symbols.erase(symbols.begin() + static_cast<std::ptrdiff_t>(best) + 1);
    }
    for (const std::string& s : symbols) {
      auto it = token_to_id_.find(s);
      if (it != token_to_id_.end()) {
        out.push_back(it->second);
        continue;
      }
      for (char c : s) {
        auto b = token_to_id_.find(std::string(1, c));
        if (b != token_to_id_.end()) out.push_back(b->second);
      }
    }
  }

  std::string token_to_piece(int32_t id) const override {
    if (id < 0 || id >= n_vocab()) return {};
    const std::string& text = tokens_[id];
    const int32_t type = types_[id];
    if (type == kControl || type == kUserDefined || type == kUnknown) return text;
    if (type == kByte) {
      // "<0xAB>"
      if (text.size() == 6 && text.rfind("<0x", 0) == 0)
        return std::string(1, static_cast<char>(std::stoi(text.substr(3, 2), nullptr, 16)));
      return text;
    }
    // llama_decode_text: map each code point back to its byte.
    std::string bytes;
    for (size_t i = 0; i < text.size();) {
      const auto c = static_cast<unsigned char>(text[i]);
      uint32_t cp;
      size_t len;
      if (c < 0x80) {
        cp = c;
        len = 1;
      } else if ((c >> 5) == 6 && i + 1 < text.size()) {
        cp = ((c & 0x1Fu) << 6) | (static_cast<unsigned char>(text[i + 1]) & 0x3Fu);
        len = 2;
      } else if ((c >> 4) == 14 && i + 2 < text.size()) {
        cp = ((c & 0x0Fu) << 12) | ((static_cast<unsigned char>(text[i + 1]) & 0x3Fu) << 6) |
             (static_cast<unsigned char>(text[i + 2]) & 0x3Fu);
        len = 3;
      } else {
        bytes.append(text, i, std::string::npos);
        break;
      }
      auto it = codepoint_to_byte_.find(cp);
      if (it != codepoint_to_byte_.end())
        bytes.push_back(static_cast<char>(it->second));
      else
        bytes.append(text, i, len);
      i += len;
    }
    return bytes;
  }

  std::string detokenize(std::span<const int32_t> ids) const override {
    std::string s;
    for (int32_t id : ids) s += token_to_piece(id);
    return s;
  }
};

Result<std::optional<int32_t>> optional_id(const layout::GgufMetadata& md, const char* key, int32_t n_vocab,
                                           std::string_view name) {
  auto v = md.find_u32(key);
  if (!v) return fail(v.error().with_context(fmt::format("model {}", name)));
  if (!*v) return std::optional<int32_t>{};
  if (**v >= static_cast<uint32_t>(n_vocab))
    return fail(EINVAL, "model {}: key \"{}\" is {}, outside the vocabulary of {} tokens", name, key, **v, n_vocab);
  return std::optional<int32_t>{static_cast<int32_t>(**v)};
}

Result<std::vector<std::string>> string_array(const layout::GgufMetadata& md, const char* key, std::string_view name,
                                              bool optional) {
  if (optional && !md.contains(key)) return std::vector<std::string>{};
  auto arr = md.get_array(key);
  if (!arr) return fail(arr.error().with_context(fmt::format("model {}", name)));
  std::vector<std::string> out;
  out.reserve((*arr)->elements.size());
  for (size_t i = 0; i < (*arr)->elements.size(); ++i) {
    const auto* s = (*arr)->elements[i].get_if<std::string>();
    if (s == nullptr) return fail(EINVAL, "model {}: key \"{}\" element {} is not a string", name, key, i);
    out.push_back(*s);
  }
  return out;
}

}  // namespace

Result<std::unique_ptr<Tokenizer>> make_tokenizer(const layout::GgufMetadata& md, std::string_view name) {
  auto t = std::make_unique<BpeTokenizer>();
  t->name_ = std::string(name);
  auto model = md.get_string("tokenizer.ggml.model");
  if (!model) return fail(model.error().with_context(fmt::format("model {}", name)));
  t->model_ = *model;
  if (md.contains("tokenizer.ggml.pre")) {
    auto pre = md.get_string("tokenizer.ggml.pre");
    if (!pre) return fail(pre.error().with_context(fmt::format("model {}", name)));
    t->pre_ = *pre;
  }
  auto tokens = string_array(md, "tokenizer.ggml.tokens", name, false);
  if (!tokens) return fail(tokens.error());
  t->tokens_ = std::move(*tokens);
  const auto n_vocab = static_cast<int32_t>(t->tokens_.size());
  t->types_.assign(t->tokens_.size(), kNormal);
  if (md.contains("tokenizer.ggml.token_type")) {
    auto arr = md.get_array("tokenizer.ggml.token_type");
    if (!arr) return fail(arr.error().with_context(fmt::format("model {}", name)));
    if ((*arr)->elements.size() != t->tokens_.size())
      return fail(EINVAL, "model {}: tokenizer.ggml.token_type has {} elements, tokenizer.ggml.tokens {}", name,
                  (*arr)->elements.size(), t->tokens_.size());
    for (size_t i = 0; i < t->types_.size(); ++i) {
      const auto* v = (*arr)->elements[i].get_if<int32_t>();
      if (v == nullptr) return fail(EINVAL, "model {}: tokenizer.ggml.token_type element {} is not an int32", name, i);
      t->types_[i] = *v;
    }
  }
  for (int32_t id = 0; id < n_vocab; ++id) t->token_to_id_.emplace(t->tokens_[id], id);

  auto merges = string_array(md, "tokenizer.ggml.merges", name, t->model_ != "gpt2");
  if (!merges) return fail(merges.error());
  for (size_t i = 0; i < merges->size(); ++i) {
    const std::string& m = (*merges)[i];
    const size_t sp = m.find(' ', 1);
    if (sp == std::string::npos)
      return fail(EINVAL, "model {}: tokenizer.ggml.merges[{}] \"{}\" has no space", name, i, m);
    t->merge_rank_.emplace(m, static_cast<int32_t>(i));
  }

  for (int b = 0; b < 256; ++b) {
    const uint32_t cp = gpt2_byte_to_codepoint(static_cast<uint8_t>(b));
    t->byte_text_.push_back(codepoint_to_utf8(cp));
    t->codepoint_to_byte_.emplace(cp, static_cast<uint8_t>(b));
  }

  for (auto [key, dst] :
       {std::pair{"tokenizer.ggml.bos_token_id", &t->bos_}, std::pair{"tokenizer.ggml.eos_token_id", &t->eos_},
        std::pair{"tokenizer.ggml.eot_token_id", &t->eot_}}) {
    auto id = optional_id(md, key, n_vocab, name);
    if (!id) return fail(id.error());
    if (*id) *dst = **id;
  }
  for (auto [key, dst] : {std::pair{"tokenizer.ggml.add_bos_token", &t->add_bos_},
                          std::pair{"tokenizer.ggml.add_eos_token", &t->add_eos_}}) {
    if (!md.contains(key)) continue;
    auto v = md.get_bool(key);
    if (!v) return fail(v.error().with_context(fmt::format("model {}", name)));
    *dst = *v;
  }

  // End of generation: eos, eot, and the end-of-turn texts llama_vocab::load marks EOG.
  if (t->eos_ >= 0) t->eog_.push_back(t->eos_);
  if (t->eot_ >= 0) t->eog_.push_back(t->eot_);
  for (const char* text :
       {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>"}) {
    auto it = t->token_to_id_.find(text);
    if (it != t->token_to_id_.end() && !t->is_end_of_generation(it->second)) t->eog_.push_back(it->second);
  }

  for (int32_t id = 0; id < n_vocab; ++id)
    if (t->types_[id] == kControl || t->types_[id] == kUserDefined || t->types_[id] == kUnknown)
      t->specials_.push_back(id);
  std::stable_sort(t->specials_.begin(), t->specials_.end(),
                   [&](int32_t a, int32_t b) { return t->tokens_[a].size() > t->tokens_[b].size(); });

  const bool gpt2_pre = t->pre_ == "gpt-2";
  const bool qwen2_pre = t->pre_ == "qwen2" || t->pre_ == "deepseek-r1-qwen";
  t->supports_text_ = t->model_ == "gpt2" && (gpt2_pre || qwen2_pre);
  t->qwen2_rules_ = qwen2_pre;
  return std::unique_ptr<Tokenizer>(std::move(t));
}

}  // namespace kvshare::refmodel
