// Files a kvshare-bench group reads or writes: the built tools, logs, and the scratch
// directory for state files and sockets.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "bench_registry.h"

namespace kvshare::bench {

// A tool built beside kvshare-bench (KVSHARE_BIN_DIR, set by tests/bench/CMakeLists.txt).
inline std::filesystem::path bin(const std::string& name) { return std::filesystem::path(KVSHARE_BIN_DIR) / name; }

inline std::string read_all(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Where the group writes its scratch files: `--dir D` after --, else TMPDIR, else /tmp.
inline std::filesystem::path scratch_dir(const BenchArgs& args) {
  const char* tmp = std::getenv("TMPDIR");
  std::filesystem::path dir = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
  for (size_t i = 0; i + 1 < args.rest.size(); ++i)
    if (args.rest[i] == "--dir") dir = args.rest[++i];
  return dir;
}

}  // namespace kvshare::bench
