#include "kvshare/env.h"

#include <cerrno>
#include <cstdlib>

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

}  // namespace kvshare
