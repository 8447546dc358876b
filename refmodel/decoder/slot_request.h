// The bodies of POST /slots/N?action=save|restore|share|adopt, parsed apart from the HTTP
// server so that a fuzzer reaches them (tests/fuzz/http_body_fuzz.cc). Every body gives a
// request or the ApiError llama-server answers with, never an exception.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "refmodel/decoder/api_error.h"

namespace kvshare::decoder {

// save / restore: {"filename": "..."}. As llama-server's handle_slots_save/restore:
// JSON or field errors are a 500 carrying nlohmann's text (its ex_wrapper), a name that
// fs_validate_filename refuses is 400 "Invalid filename".
struct SlotFileRequest {
  std::string filename;
};
ApiResult<SlotFileRequest> parse_slot_file_request(std::string_view body);

// share: {"socket": "<path of the broker's AF_UNIX socket>"} (the remote route too: its
// receiver process is that broker, docs/remote.md); 400 otherwise. The path is checked by
// the one who connects (handshake::connect_checked_listener), not here.
struct ShareRequest {
  std::string socket;
};
ApiResult<ShareRequest> parse_share_request(std::string_view body);

// adopt: {"tokens": [ids...], "share_id": N}; 400 naming what is missing or mistyped.
struct AdoptRequest {
  std::vector<int32_t> tokens;
  uint64_t share_id = 0;
};
ApiResult<AdoptRequest> parse_adopt_request(std::string_view body);

}  // namespace kvshare::decoder
