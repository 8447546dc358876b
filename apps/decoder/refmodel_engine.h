// The SlotEngine of kvshare-decoder: refmodel's CPU transformer over a KV cache laid out
// by share_layout, llama.cpp sequence-state files for save/restore (kvshare/statefile),
// and, with ONEBIT_KV_SHARE, the cache in exported regions handed over by share/adopt.
#pragma once

#include <filesystem>
#include <memory>
#include <string>

#include "apps/decoder/slot_engine.h"
#include "layout/kv_params.h"
#include "layout/state_format.h"

namespace kvshare::decoder {

struct RefEngineOptions {
  std::filesystem::path model_path;
  std::string model_name;   // how the model is named in messages (-m as given)
  layout::KvParams params;  // n_ctx 0: the model's training context
  int n_threads = 0;        // 0: hardware threads
  // ONEBIT_KV_SHARE was set: put the cache in exported regions (memfd or dma-buf) so
  // share/adopt work. When no backend can export, the engine says so on stderr once and
  // answers share with the "cannot export" refusal.
  bool share_requested = false;
  // The LLAMA_STATE_SEQ_VERSION this decoder mirrors: its saves write it and its restores
  // refuse any other, as llama_state_seq_load_file does (2: llama-server d32676d, 3: current).
  uint32_t state_version = layout::kStateSeqVersionLatest;
};

// Loads the model (mapped, not copied), derives the cache shape, allocates the cache and
// creates the context. Fails naming the model file, the unsupported memory kind or arch,
// or the params llama.cpp would refuse. Says on stderr which KV backend it used.
Result<std::unique_ptr<SlotEngine>> load_refmodel_engine(const RefEngineOptions& options);

}  // namespace kvshare::decoder
