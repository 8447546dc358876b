#include "route/api_key.h"

#include <algorithm>
#include <cerrno>
#include <fstream>

namespace kvshare::route {
namespace {

// Every byte of both strings is looked at whatever their contents, so the time a wrong
// key takes does not say how many of its leading bytes were right.
bool same_bytes(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const auto x = static_cast<unsigned char>(i < a.size() ? a[i] : 0);
    const auto y = static_cast<unsigned char>(i < b.size() ? b[i] : 0);
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

}  // namespace

bool is_public_endpoint(std::string_view path) { return path == "/health" || path == "/v1/health"; }

bool api_key_accepted(const std::vector<std::string>& keys, std::string_view authorization,
                      std::string_view x_api_key) {
  if (keys.empty()) return true;
  std::string_view given = authorization.empty() ? x_api_key : authorization;
  // As llama-server: the "Bearer " prefix is optional.
  constexpr std::string_view kBearer = "Bearer ";
  if (given.substr(0, kBearer.size()) == kBearer) given.remove_prefix(kBearer.size());
  bool accepted = false;
  for (const auto& key : keys) accepted = same_bytes(given, key) || accepted;
  return accepted;
}

std::vector<std::string> parse_api_key_list(std::string_view csv) {
  std::vector<std::string> keys;
  size_t start = 0;
  while (start <= csv.size()) {
    const size_t comma = std::min(csv.find(',', start), csv.size());
    if (comma > start) keys.emplace_back(csv.substr(start, comma - start));
    start = comma + 1;
  }
  return keys;
}

Result<std::vector<std::string>> read_api_key_file(const std::filesystem::path& path) {
  std::ifstream file(path);
  if (!file) return fail(errno != 0 ? errno : ENOENT, "--api-key-file {}: cannot open", path.string());
  std::vector<std::string> keys;
  std::string line;
  while (std::getline(file, line)) {
    if (!line.empty() && line.front() != '#') keys.push_back(line);
  }
  return keys;
}

}  // namespace kvshare::route
