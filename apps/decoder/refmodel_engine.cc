#include "apps/decoder/refmodel_engine.h"

#include <fmt/format.h>

#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "kvshare/mapping.h"
#include "kvshare/region/backend.h"
#include "kvshare/share/decoder_share.h"
#include "kvshare/statefile/state_file_reader.h"
#include "kvshare/statefile/state_file_writer.h"
#include "layout/memory_shape.h"
#include "layout/share_header.h"
#include "layout/share_layout.h"
#include "refmodel/engine.h"

namespace kvshare::decoder {
namespace {

// Where one cache tensor of layer `il` lives in the KV memory.
struct TensorPlace {
  std::byte* base = nullptr;
  const layout::SharedTensor* tensor = nullptr;
};

class RefModelEngine final : public SlotEngine {
 public:
  RefModelEngine(std::shared_ptr<const refmodel::Model> model, std::unique_ptr<refmodel::Context> context,
                 refmodel::KvMemory kv, std::vector<std::vector<std::byte>> buffers,
                 std::unique_ptr<DecoderShare> shared, ModelInfo info, ShareAvailability share,
                 std::string share_failure, uint32_t state_version)
      : state_version_(state_version),
        model_(std::move(model)),
        context_(std::move(context)),
        kv_(std::move(kv)),
        buffers_(std::move(buffers)),
        shared_(std::move(shared)),
        info_(std::move(info)),
        share_(share),
        share_failure_(std::move(share_failure)) {}

  const ModelInfo& info() const override { return info_; }
  int32_t n_ctx() const override { return context_->n_ctx(); }
  int32_t n_vocab() const override { return model_->tokenizer().n_vocab(); }

  Result<std::vector<int32_t>> tokenize(std::string_view text, bool add_special, bool parse_special) const override {
    return model_->tokenizer().tokenize(text, add_special, parse_special);
  }

  std::string token_to_piece(int32_t id, bool special) const override {
    const auto& tok = model_->tokenizer();
    if (!special && is_control(id)) return {};
    return tok.token_to_piece(id);
  }

  bool is_end_of_generation(int32_t id) const override { return model_->tokenizer().is_end_of_generation(id); }

  Result<std::string> apply_chat_template(const std::vector<refmodel::ChatMessage>& messages,
                                          bool add_generation_prompt) const override {
    return model_->apply_chat_template(messages, add_generation_prompt);
  }

  Result<std::vector<float>> eval(std::span<const int32_t> tokens, int32_t pos0) override {
    return context_->decode(tokens, pos0);
  }

  Result<uint64_t> save_state(const std::filesystem::path& path, std::span<const int32_t> tokens) override;
  Result<RestoredState> restore_state(const std::filesystem::path& path, uint32_t max_tokens) override;

  ShareAvailability share_availability() const override { return share_; }
  std::string share_refusal() const override {
    if (share_ == ShareAvailability::cannot_export) return share_failure_;
    return SlotEngine::share_refusal();
  }

  Result<ShareReply> share(const std::string& socket_path) override {
    if (shared_ == nullptr || !shared_->can_share()) return fail(ENOTSUP, "{}", share_refusal());
    auto id = shared_->share(socket_path);
    if (!id) return fail(id.error());
    ShareReply reply;
    reply.share_id = *id;
    reply.backend = std::string(region_backend_name(shared_->regions().front().backend));
    reply.n_fds = static_cast<uint32_t>(shared_->regions().size());
    reply.region_bytes = shared_->header().layout.total_bytes();
    return reply;
  }

  // No data moves: the provider wrote cells 0..n-1 of the region the context reads.
  tl::expected<void, AdoptError> adopt(std::span<const int32_t> tokens, uint64_t share_id) override {
    if (shared_ == nullptr || !shared_->can_share()) {
      return tl::unexpected(AdoptError{AdoptRefusal::other, Error(ENOTSUP, share_refusal())});
    }
    // Which share ids are adoptable (sent, latest of their cells, not yet adopted) is
    // DecoderShare's rule, the same one the C API's decoder applies.
    auto plan = shared_->adopt(tokens.size(), share_id);
    if (!plan) {
      const int e = plan.error().errno_value();
      const AdoptRefusal kind = e == ESTALE                  ? AdoptRefusal::stale_share_id
                                : e == ERANGE || e == EINVAL ? AdoptRefusal::too_many_tokens
                                                             : AdoptRefusal::other;
      return tl::unexpected(AdoptError{kind, plan.error()});
    }
    return {};
  }

 private:
  // llama.cpp renders a control (or unknown) token as "" when `special` is false. The
  // tokenizer interface has no attributes, so tell them by behaviour: a control token's
  // text is matched as that token only when parse_special is on.
  bool is_control(int32_t id) const {
    std::lock_guard lock(control_mutex_);
    auto it = control_cache_.find(id);
    if (it != control_cache_.end()) return it->second;
    const auto& tok = model_->tokenizer();
    bool control = id == tok.bos_id() || id == tok.eos_id() || tok.is_end_of_generation(id);
    if (!control && tok.supports_text()) {
      const std::string text = tok.token_to_piece(id);
      auto with = tok.tokenize(text, false, true);
      auto without = tok.tokenize(text, false, false);
      control = with && without && with->size() == 1 && (*with)[0] == id && *without != *with;
    }
    control_cache_.emplace(id, control);
    return control;
  }

  TensorPlace place(uint32_t il, layout::TensorKind kind) const {
    const layout::SharedTensor* t = kv_.layout.find(0, il, kind);
    if (t == nullptr) return {};
    return {kv_.chunks[t->chunk].data() + t->offset, t};
  }

  uint32_t state_version_;  // LLAMA_STATE_SEQ_VERSION saved and restored
  std::shared_ptr<const refmodel::Model> model_;
  std::unique_ptr<refmodel::Context> context_;
  refmodel::KvMemory kv_;
  std::vector<std::vector<std::byte>> buffers_;  // the private cache (empty when exported)
  std::unique_ptr<DecoderShare> shared_;         // the exported cache (null when private)
  ModelInfo info_;
  ShareAvailability share_;
  std::string share_failure_;  // why export failed, for the 501
  mutable std::mutex control_mutex_;
  mutable std::unordered_map<int32_t, bool> control_cache_;
};

Result<uint64_t> RefModelEngine::save_state(const std::filesystem::path& path, std::span<const int32_t> tokens) {
  const layout::MemoryShape& memory = kv_.memory;
  const layout::KvCacheShape& cache = memory.kv_caches.front();
  statefile::StateFileWriterOptions options;
  const auto& layers = model_->shape().layers;
  if (!layers.empty()) {
    options.n_embd_head_k = layers.front().n_embd_head_k;
    options.n_embd_head_v = layers.front().n_embd_head_v;
  }
  options.rotation_disabled = statefile::attn_rotation_disabled_by_env();
  options.state_version = state_version_;
  const auto n_cells = static_cast<uint32_t>(tokens.size());
  auto writer = statefile::StateFileWriter::create(path, memory, tokens, static_cast<int32_t>(n_cells), options);
  if (!writer) return fail(writer.error());
  std::vector<std::byte> gathered;
  // An empty slot's file has no sections: llama.cpp writes the stream's cell count 0 and
  // nothing after it (serve's state-version probe saves exactly that).
  for (const layout::KvCacheLayer& layer :
       n_cells == 0 ? std::span<const layout::KvCacheLayer>{} : std::span<const layout::KvCacheLayer>(cache.layers)) {
    const TensorPlace k = place(layer.il, layout::TensorKind::k);
    const TensorPlace v = place(layer.il, layout::TensorKind::v);
    if (k.base == nullptr)
      return fail(EINVAL, "save {}: layer {} has no K tensor in the cache", path.string(), layer.il);
    statefile::RowsView k_rows{cache.type_k, k.base, n_cells, k.tensor->tensor.row_bytes};
    statefile::RowsView v_rows;
    if (layer.has_v && v.base != nullptr) {
      if (!cache.v_trans) {
        v_rows = {cache.type_v, v.base, n_cells, v.tensor->tensor.row_bytes};
      } else {
        // V is element-major in a v_trans cache: gather each cell's row.
        const uint64_t elem = layout::ggml_row_size(cache.type_v, 1);
        // Element j of cell c at (j * kv_size + c) * elem, as refmodel's store_kv and
        // kvshare::scatter place it: one element row spans every cell, not the V width.
        const uint64_t stride = static_cast<uint64_t>(cache.kv_size) * elem;
        gathered.assign(static_cast<size_t>(n_cells) * layer.n_embd_v_gqa * elem, std::byte{0});
        for (uint32_t c = 0; c < n_cells; ++c) {
          for (uint32_t j = 0; j < layer.n_embd_v_gqa; ++j) {
            std::memcpy(gathered.data() + (static_cast<size_t>(c) * layer.n_embd_v_gqa + j) * elem,
                        v.base + j * stride + c * elem, elem);
          }
        }
        v_rows = {cache.type_v, gathered.data(), n_cells, 0};
      }
    }
    if (auto written = writer->write_layer(layer.il, k_rows, v_rows); !written) return fail(written.error());
  }
  auto committed = writer->commit();
  if (!committed) return fail(committed.error());
  return committed->size_bytes;
}

Result<RestoredState> RefModelEngine::restore_state(const std::filesystem::path& path, uint32_t max_tokens) {
  const layout::MemoryShape& memory = kv_.memory;
  const layout::KvCacheShape& cache = memory.kv_caches.front();
  auto file = statefile::read_state_file(path, &memory);
  if (!file) return fail(file.error());
  if (file->layout().version != state_version_)
    return fail(EINVAL,
                "state file {}: state version {}, this decoder reads version {} only (as "
                "llama_state_seq_load_file: \"unknown (magic, version) for sequence state file\")",
                path.string(), file->layout().version, state_version_);
  if (file->tokens().size() > max_tokens) {
    return fail(ENOSPC, "state file {}: {} tokens, the slot holds at most {}", path.string(), file->tokens().size(),
                max_tokens);
  }
  const layout::StateBlock* block = nullptr;
  for (const auto& b : file->layout().blocks) {
    if (b.kind == layout::StateBlockKind::kv) block = &b;
  }
  const layout::StateStream* stream = block ? block->filled_stream() : nullptr;
  const uint32_t n_cells = stream ? stream->cell_count : 0;
  if (stream != nullptr) {
    for (uint32_t i = 0; i < n_cells; ++i) {
      const layout::StateCell& cell = stream->cells[i];
      if (cell.pos != static_cast<int32_t>(i) || cell.n_seq_id != 1 || cell.seq_id != 0) {
        return fail(EINVAL,
                    "state file {}: cell {} is at position {} (sequence {}); this decoder restores "
                    "positions 0..n-1 of sequence 0 in order",
                    path.string(), i, cell.pos, cell.seq_id);
      }
    }
  }
  if (n_cells != file->tokens().size()) {
    return fail(EINVAL, "state file {}: {} cells for {} tokens; this decoder needs one cell per token", path.string(),
                n_cells, file->tokens().size());
  }
  for (const layout::StateSection* section : file->sections()) {
    const TensorPlace dst = place(section->il, section->kind);
    if (dst.base == nullptr) {
      return fail(EINVAL, "state file {}: section {} of layer {} has no tensor in this cache", path.string(),
                  layout::tensor_kind_name(section->kind), section->il);
    }
    const std::vector<std::byte> rows = file->rows(*section);
    const uint64_t row_bytes = section->row_bytes;
    if (section->kind == layout::TensorKind::v && cache.v_trans) {
      const uint64_t elem = layout::ggml_row_size(cache.type_v, 1);
      const uint64_t stride = static_cast<uint64_t>(cache.kv_size) * elem;  // one element of every cell
      for (uint32_t c = 0; c < section->n_rows; ++c) {
        for (uint32_t j = 0; j < section->n_embd; ++j) {
          std::memcpy(dst.base + j * stride + c * elem,
                      rows.data() + (static_cast<size_t>(c) * section->n_embd + j) * elem, elem);
        }
      }
    } else {
      for (uint32_t c = 0; c < section->n_rows; ++c) {
        std::memcpy(dst.base + c * dst.tensor->tensor.row_bytes, rows.data() + c * row_bytes, row_bytes);
      }
    }
  }
  RestoredState state;
  state.tokens = file->tokens();
  state.n_bytes_read = file->bytes().size();
  return state;
}

}  // namespace

Result<std::unique_ptr<SlotEngine>> load_refmodel_engine(const RefEngineOptions& options) {
  auto mapping = Mapping::map_file_readonly(options.model_path.string());
  if (!mapping) return fail(mapping.error().with_context(fmt::format("model {}", options.model_path.string())));
  auto owned = std::make_shared<Mapping>(std::move(*mapping));
  auto model = refmodel::Model::from_gguf(owned->bytes(), owned, options.model_name);
  if (!model) return fail(model.error().with_context(fmt::format("model {}", options.model_path.string())));

  layout::KvParams params = options.params;
  if (params.n_ctx == 0) params.n_ctx = (*model)->shape().n_ctx_train;
  if (auto valid = layout::validate(params); !valid) return fail(valid.error());
  auto memory = layout::derive_memory_shape((*model)->shape(), params);
  if (!memory) return fail(memory.error().with_context(fmt::format("model {}", options.model_path.string())));
  if (memory->kind != layout::MemoryKind::kv || memory->kv_caches.size() != 1) {
    return fail(ENOTSUP, "model {}: memory kind {} is not supported by kvshare-decoder (plain KV caches only)",
                options.model_path.string(), layout::memory_kind_name(memory->kind));
  }

  refmodel::KvMemory kv;
  std::vector<std::vector<std::byte>> buffers;
  std::unique_ptr<DecoderShare> shared;
  ShareAvailability share = ShareAvailability::flag_not_set;
  std::string share_failure;
  if (options.share_requested) {
    // The cache lives in the regions a share hands over: the header is built from the
    // same shape and params, so a provider's layout is this cache's layout byte for byte.
    const auto fingerprint = layout::model_fingerprint((*model)->metadata(), (*model)->tensor_infos());
    auto header = layout::make_share_header(fingerprint, (*model)->shape(), params);
    if (!header) return fail(header.error().with_context(fmt::format("model {}", options.model_path.string())));
    auto export_options = ExportOptions::from_env();
    if (!export_options) return fail(export_options.error());
    shared = std::make_unique<DecoderShare>(DecoderShare::start(*header, true, *export_options));
    if (shared->can_share()) {
      share = ShareAvailability::enabled;
      kv.memory = shared->header().memory;
      kv.layout = shared->header().layout;
      for (auto bytes : shared->chunk_bytes()) kv.chunks.push_back(bytes);
      std::fprintf(stderr, "kvshare-decoder: KV cache: exported region, %llu bytes in %zu chunk(s), backend %s\n",
                   static_cast<unsigned long long>(kv.layout.total_bytes()), kv.chunks.size(),
                   shared->backend_description().c_str());
    } else {
      share = ShareAvailability::cannot_export;
      // DecoderShare's own refusal text: both causes, with why no backend exported.
      share_failure = shared->view("cache_k_l0").error().message();
      std::fprintf(stderr, "kvshare-decoder: %s\n", shared->startup_warning().c_str());
      shared.reset();
    }
  }
  if (share != ShareAvailability::enabled) {
    kv.memory = *memory;
    kv.layout = layout::share_layout(*memory);
    for (const auto& chunk : kv.layout.chunks) buffers.emplace_back(chunk.size_bytes);
    for (auto& b : buffers) kv.chunks.emplace_back(b);
    if (share == ShareAvailability::flag_not_set) {
      std::fprintf(stderr, "kvshare-decoder: KV cache: private buffer, %llu bytes (ONEBIT_KV_SHARE unset)\n",
                   static_cast<unsigned long long>(kv.layout.total_bytes()));
    }
  }

  const int n_threads =
      options.n_threads > 0 ? options.n_threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  auto context = refmodel::Context::create(*model, kv, n_threads);
  if (!context) return fail(context.error().with_context(fmt::format("model {}", options.model_path.string())));

  ModelInfo info;
  const auto& tok = (*model)->tokenizer();
  info.model_path = options.model_path.string();
  if ((*model)->metadata().contains("tokenizer.chat_template")) {
    if (auto tmpl = (*model)->metadata().get_string("tokenizer.chat_template")) info.chat_template = *tmpl;
  }
  if (tok.bos_id() >= 0) info.bos_token = tok.token_to_piece(tok.bos_id());
  if (tok.eos_id() >= 0) info.eos_token = tok.token_to_piece(tok.eos_id());
  info.n_vocab = tok.n_vocab();
  info.n_ctx_train = static_cast<int32_t>((*model)->shape().n_ctx_train);
  info.n_embd = static_cast<int32_t>((*model)->shape().n_embd);
  info.size_bytes = owned->size();
  auto engine = std::make_unique<RefModelEngine>(*model, std::move(*context), std::move(kv), std::move(buffers),
                                                 std::move(shared), std::move(info), share, std::move(share_failure),
                                                 options.state_version);
  return std::unique_ptr<SlotEngine>(std::move(engine));
}

}  // namespace kvshare::decoder
