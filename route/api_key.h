// llama-server's --api-key, as kvshare-decoder and kvshare-serve apply it
// (tools/server/server-http.cpp, middleware_validate_api_key): with no key every request
// passes; with keys, every path but /health and /v1/health needs one of them in
// "Authorization: Bearer KEY" (or, failing an Authorization header, "X-Api-Key: KEY"),
// and anything else is answered 401 with kInvalidApiKeyBody. Slot actions are the reason
// it matters here: share hands a process the decoder's KV memory, as privileged as restore.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "layout/error.h"

namespace kvshare::route {

// llama-server's 401 body, byte for byte (its json keys sort: code, message, type).
inline constexpr std::string_view kInvalidApiKeyBody =
    R"({"error":{"code":401,"message":"Invalid API Key","type":"authentication_error"}})";

// The paths that stay open with a key set.
bool is_public_endpoint(std::string_view path);

// Whether a request with these header values (empty: absent) may pass. No keys: always.
// Compares in time independent of where a wrong key differs.
bool api_key_accepted(const std::vector<std::string>& keys, std::string_view authorization, std::string_view x_api_key);

// --api-key's value: a comma-separated list; empty entries are dropped (common/arg.cpp).
std::vector<std::string> parse_api_key_list(std::string_view csv);

// --api-key-file: one key per line, "#" lines are comments. ENOENT/EACCES naming the path.
Result<std::vector<std::string>> read_api_key_file(const std::filesystem::path& path);

}  // namespace kvshare::route
