// Helpers of the refmodel tests: a generated tiny model loaded in memory, and a KV
// memory in a plain buffer laid out by share_layout.
#pragma once

#include <memory>
#include <vector>

#include "layout/kv_params.h"
#include "layout/memory_shape.h"
#include "layout/share_layout.h"
#include "refmodel/engine.h"
#include "refmodel/model_generator.h"

namespace kvshare::refmodel::testing {

// Generates and loads a model (fails the test on error).
inline std::shared_ptr<const Model> load_generated(const GeneratorOptions& options) {
  auto bytes = generate_model_bytes(options);
  EXPECT_TRUE(bytes.has_value()) << (bytes ? "" : bytes.error().what());
  if (!bytes) return nullptr;
  auto owned = std::make_shared<std::vector<std::byte>>(std::move(*bytes));
  auto model = Model::from_gguf(*owned, owned, "generated");
  EXPECT_TRUE(model.has_value()) << (model ? "" : model.error().what());
  return model ? *model : nullptr;
}

// A KV memory in heap buffers, as share_layout places it.
struct BufferKv {
  std::vector<std::vector<std::byte>> buffers;
  KvMemory kv;
};

inline std::unique_ptr<BufferKv> make_buffer_kv(const Model& model, const layout::KvParams& params) {
  auto memory = layout::derive_memory_shape(model.shape(), params);
  EXPECT_TRUE(memory.has_value()) << (memory ? "" : memory.error().what());
  if (!memory) return nullptr;
  auto out = std::make_unique<BufferKv>();
  out->kv.memory = *memory;
  out->kv.layout = layout::share_layout(*memory);
  for (const auto& chunk : out->kv.layout.chunks) out->buffers.emplace_back(chunk.size_bytes);
  for (auto& b : out->buffers) out->kv.chunks.emplace_back(b);
  return out;
}

inline layout::KvParams small_params(uint32_t n_ctx = 256, layout::GgmlType type_k = layout::GgmlType::F16,
                                     layout::GgmlType type_v = layout::GgmlType::F16, bool flash_attn = true) {
  layout::KvParams p;
  p.n_ctx = n_ctx;
  p.type_k = type_k;
  p.type_v = type_v;
  p.flash_attn = flash_attn;
  return p;
}

}  // namespace kvshare::refmodel::testing
