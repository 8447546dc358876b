// The environment switches kvshare reads, in one place so every side reads them alike.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "kvshare/region/backend.h"
#include "layout/error.h"

namespace kvshare {

// ONEBIT_KV_SHARE turns the shared route on. Read as "set and non-empty", like the patched llama-server's
// decoder and serve: ONEBIT_KV_SHARE=0 is ON too; the opt-out is an unset variable.
inline constexpr const char* kKvShareEnv = "ONEBIT_KV_SHARE";
// KVSHARE_EXPORT=memfd|udmabuf|dmaheap forces one export backend (no fallback).
inline constexpr const char* kExportBackendEnv = "KVSHARE_EXPORT";
// ONEBIT_HYBRID_STATE_VERSION=2|3: the state-file version the decoder restores. serve sets it
// in every file-route provider's environment (it learned the version from the decoder at
// start), so a provider that knows it writes what the decoder reads and one that does not
// is unaffected (docs/state-file.md, "Which version to write").
inline constexpr const char* kStateVersionEnv = "ONEBIT_HYBRID_STATE_VERSION";

// The "set and non-empty" rule on a getenv() value (nullptr = unset).
bool is_set_and_non_empty(const char* value);

// Whether ONEBIT_KV_SHARE turns the shared route on in this process.
bool kv_share_enabled();

// The backend KVSHARE_EXPORT forces, nullopt when unset or empty (choose automatically).
// An unknown value is an error naming the variable and the allowed values.
Result<std::optional<RegionBackend>> export_backend_override();

// The version ONEBIT_HYBRID_STATE_VERSION names, nullopt when unset or empty. Anything but 2
// or 3 is an error naming the variable.
Result<std::optional<uint32_t>> state_version_from_env();

}  // namespace kvshare
