// The bodies of POST /slots/N?action=save|restore|share|adopt, parsed apart from the HTTP
// server so that a fuzzer reaches them (tests/fuzz/http_body_fuzz.cc). Every body gives a
// request or the ApiError llama-server answers with, never an exception.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "apps/decoder/api_error.h"

namespace kvshare::decoder {

// save / restore: {"filename": "..."}. As llama-server's handle_slots_save/restore:
// JSON or field errors are a 500 carrying nlohmann's text (its ex_wrapper), a name that
// fs_validate_filename refuses is 400 "Invalid filename".
struct SlotFileRequest {
  std::string filename;
};
ApiResult<SlotFileRequest> parse_slot_file_request(std::string_view body);

// share: {"socket": "<path of the broker's AF_UNIX socket>", "tokens": [ids...]} (the
// remote route too: its receiver process is that broker, docs/remote.md); 400 otherwise.
// The path is checked by the one who connects (handshake::connect_checked_listener), not
// here. `tokens` (optional, null is absent) are the ids the caller will hand over: the
// reply says how many of them the slot already holds (n_cached). The vocabulary is the
// slot's to check.
struct ShareRequest {
  std::string socket;
  std::optional<std::vector<int32_t>> tokens;
};
ApiResult<ShareRequest> parse_share_request(std::string_view body);

// adopt: {"tokens": [ids...], "share_id": N, "n_cached": P}; 400 naming what is missing
// or mistyped. `n_cached` (optional, default 0): tokens[0..P-1] are the slot's own cells,
// kept through the share, not written by the provider.
struct AdoptRequest {
  std::vector<int32_t> tokens;
  uint64_t share_id = 0;
  uint32_t n_cached = 0;
};
ApiResult<AdoptRequest> parse_adopt_request(std::string_view body);

}  // namespace kvshare::decoder
