// Model::from_gguf: parses the image, reads hyperparameters once, loads the weights and the
// tokenizer, and renders the ChatML template the generated models carry.
#include <fmt/format.h>

#include "layout/gguf_reader.h"
#include "refmodel/bpe_tokenizer.h"
#include "refmodel/model_impl.h"

namespace kvshare::refmodel {

LoadedModel::LoadedModel(layout::GgufMetadata metadata, std::vector<layout::GgufTensorInfo> tensors,
                         layout::ModelShape shape, Hparams hparams, Weights weights,
                         std::unique_ptr<Tokenizer> tokenizer, std::string chat_template,
                         std::shared_ptr<void> keep_alive)
    : metadata_(std::move(metadata)),
      tensors_(std::move(tensors)),
      shape_(std::move(shape)),
      hparams_(std::move(hparams)),
      weights_(std::move(weights)),
      tokenizer_(std::move(tokenizer)),
      chat_template_(std::move(chat_template)),
      keep_alive_(std::move(keep_alive)) {}

Result<std::string> LoadedModel::apply_chat_template(const std::vector<ChatMessage>& messages,
                                                     bool add_generation_prompt) const {
  // ChatML, as llama-server's /apply-template renders the generated models' template
  // (and llama.cpp's built-in "chatml" template for models with an <|im_start|> one).
  if (chat_template_.find("<|im_start|>") == std::string::npos)
    return fail(ENOTSUP, "the model's chat template is not ChatML; the reference engine renders ChatML only");
  std::string out;
  for (const ChatMessage& m : messages) out += fmt::format("<|im_start|>{}\n{}<|im_end|>\n", m.role, m.content);
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

Result<std::shared_ptr<const Model>> Model::from_gguf(std::span<const std::byte> gguf_bytes,
                                                      std::shared_ptr<void> keep_alive, std::string_view name) {
  auto file = layout::parse_gguf(gguf_bytes, name);
  if (!file) return fail(file.error());
  // One read of the hyperparameters gives both the shape and the transformer's numbers.
  KVSHARE_TRY(check_transformer_arch(file->metadata, name));
  auto model_hparams = layout::read_model_hparams(file->metadata, name);
  if (!model_hparams) return fail(model_hparams.error());
  auto hparams = transformer_hparams(*model_hparams, name);
  if (!hparams) return fail(hparams.error());
  KVSHARE_TRY_ASSIGN(hparams->n_vocab, read_vocab_size(file->metadata, name));
  auto shape = layout::model_shape_from_hparams(*model_hparams);
  if (!shape) return fail(shape.error().with_context(fmt::format("model {}", name)));
  auto tokenizer = make_tokenizer(file->metadata, name);
  if (!tokenizer) return fail(tokenizer.error());
  if ((*tokenizer)->n_vocab() != static_cast<int32_t>(hparams->n_vocab))
    return fail(EINVAL, "model {}: tokenizer has {} tokens, hyperparameters say {}", name, (*tokenizer)->n_vocab(),
                hparams->n_vocab);
  const layout::GgufFile& f = *file;
  TensorLookup data_of = [&f](const layout::GgufTensorInfo& info) { return layout::tensor_data(f, info); };
  auto weights = load_weights(*hparams, file->tensors, data_of, name);
  if (!weights) return fail(weights.error());
  std::string chat_template;
  if (file->metadata.contains("tokenizer.chat_template")) {
    auto t = file->metadata.get_string("tokenizer.chat_template");
    if (!t) return fail(t.error().with_context(fmt::format("model {}", name)));
    chat_template = *t;
  }
  return std::make_shared<const LoadedModel>(std::move(file->metadata), std::move(file->tensors), std::move(*shape),
                                             std::move(*hparams), std::move(*weights), std::move(*tokenizer),
                                             std::move(chat_template), std::move(keep_alive));
}

}  // namespace kvshare::refmodel
