#include "kvshare/env.h"

#include <cerrno>
#include <cstdlib>
#include <string_view>

namespace kvshare {

bool is_set_and_non_empty(const char* value) { return value != nullptr && value[0] != '\0'; }

bool kv_share_enabled() { return is_set_and_non_empty(std::getenv(kKvShareEnv)); }

Result<std::optional<RegionBackend>> export_backend_override() {
  const char* value = std::getenv(kExportBackendEnv);
  if (!is_set_and_non_empty(value)) return std::optional<RegionBackend>{};
  auto backend = parse_region_backend(value);
  if (!backend) return fail(backend.error().with_context(kExportBackendEnv));
  return std::optional<RegionBackend>{*backend};
}

Result<std::optional<uint32_t>> state_version_from_env() {
  const char* value = std::getenv(kStateVersionEnv);
  if (!is_set_and_non_empty(value)) return std::optional<uint32_t>{};
  const std::string_view text(value);
  if (text != "2" && text != "3")
    return fail(EINVAL, "{}={}: llama.cpp state files are version 2 or 3", kStateVersionEnv, text);
  return std::optional<uint32_t>{static_cast<uint32_t>(text[0] - '0')};
}

}  // namespace kvshare
