// kvshare-serve's whole run: start the decoder child, listen, hand each prompt over (the
// hybrid route) and relay every reply, until SIGINT/SIGTERM or the decoder's death.
#pragma once

#include <chrono>
#include <filesystem>
#include <string>

#include "layout/error.h"
#include "route/serve_config.h"

namespace kvshare::route {

struct ServeRuntime {
  std::filesystem::path serve_dir;  // where kvshare-serve's binary is (for kvshare-decoder)
  std::chrono::milliseconds decoder_ready_timeout{120000};
  std::chrono::milliseconds handshake_timeout{10000};
};

// The directory of /proc/self/exe.
std::filesystem::path own_binary_dir();

// The line --print-backend prints: the decoder's command with placeholders for what is
// only known at start (the private slot directory, the free port).
std::string print_backend_line(const ServeConfig& config, const Backend& backend);

// Runs until stopped. Returns 0 after SIGINT/SIGTERM, 1 when the decoder could not start
// or died (the message is on stderr by then).
int run_serve(const ServeConfig& config, const Backend& backend, const ServeRuntime& runtime);

}  // namespace kvshare::route
