// kvshare-decoder's main, as a library function: flags with llama-server's names, the
// server bound before the model loads (503 "Loading model" meanwhile), clean shutdown on
// SIGINT/SIGTERM. tools/decoder.cc only parses flags and calls run_decoder().
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "layout/kv_params.h"

namespace kvshare::decoder {

struct DecoderOptions {
  std::filesystem::path model;           // -m
  int n_ctx = 0;                         // -c; 0: the model's training context
  int n_parallel = 1;                    // -np; only 1 is served
  int n_ubatch = 512;                    // -ub
  std::filesystem::path slot_save_path;  // --slot-save-path
  std::string host = "127.0.0.1";        // --host
  int port = 8080;                       // --port (0: any free port, printed at start)
  int n_threads = 0;                     // -t; 0: all hardware threads
  bool endpoint_slots = true;            // --slots / --no-slots
  int state_version = 3;                 // --state-version: the llama-server generation whose
                                         // state files it saves and restores (2 or 3)
  std::string api_key;                   // --api-key (LLAMA_API_KEY): comma-separated keys
  std::filesystem::path api_key_file;    // --api-key-file (LLAMA_ARG_API_KEY_FILE)

  // -fa, -ctk, -ctv as typed, from llama-server's defaults; read by layout::apply_kv_flags.
  std::string flash_attn{layout::kDefaultFlashAttn};
  std::string cache_type_k{layout::kDefaultCacheType};
  std::string cache_type_v{layout::kDefaultCacheType};
};

// Runs the decoder until SIGINT or SIGTERM. Returns the process exit code: 0 after a
// clean shutdown, 1 when the model or the server failed (said on stderr), 2 for options
// that cannot be served (-np > 1, an unknown -fa or cache type, a missing slot directory).
int run_decoder(const DecoderOptions& options);

}  // namespace kvshare::decoder
