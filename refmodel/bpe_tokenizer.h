// The byte-level BPE tokenizer of GGUF vocabularies with tokenizer.ggml.model "gpt2":
// llama.cpp's llm_tokenizer_bpe (src/llama-vocab.cpp) with its pre-tokenizer splits
// (src/unicode.cpp unicode_regex_split_custom_gpt2 / _qwen2) for the pre types "gpt-2"
// and "qwen2". Text must be ASCII: the splits need Unicode categories beyond it, which
// this tokenizer does not carry, so other text is refused rather than tokenized wrongly.
#pragma once

#include <memory>
#include <string_view>

#include "layout/gguf_value.h"
#include "refmodel/engine.h"

namespace kvshare::refmodel {

// Builds the tokenizer of `metadata` (`name` labels messages). Any vocabulary loads;
// supports_text() is true only for model "gpt2" with a pre type it implements. Fails
// when the vocabulary keys are missing or malformed (naming the key).
Result<std::unique_ptr<Tokenizer>> make_tokenizer(const layout::GgufMetadata& metadata, std::string_view name);

// GPT-2's bytes_to_unicode: the code point byte `b` is written as in vocabulary text.
uint32_t gpt2_byte_to_codepoint(uint8_t b);

// The pre-tokenizer split of ASCII `text` into words for pre type "gpt-2" or "qwen2".
std::vector<std::string> pre_tokenize_ascii(std::string_view text, bool qwen2_rules);

}  // namespace kvshare::refmodel
