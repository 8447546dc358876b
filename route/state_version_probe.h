// Which sequence-state version the decoder restores. A llama.cpp decoder reads exactly its
// own LLAMA_STATE_SEQ_VERSION (2 before the cell token extension, 3 since) and nothing tells
// it over HTTP, so serve asks the way a file would: it saves the decoder's empty slot 0 once
// at start and reads the version word of that file. Providers then learn it from
// ONEBIT_HYBRID_STATE_VERSION, and a file of another version is caught before the restore.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include "layout/error.h"
#include "route/decoder_client.h"

namespace kvshare::route {

// Saves slot 0 (expected empty: call before any request) as a probe file in `slot_dir`, reads
// its version and removes it. Blocks for one save (milliseconds for an empty slot). Fails
// naming the save's answer, or the file and what its header holds.
Result<uint32_t> probe_decoder_state_version(const DecoderClient& decoder, const std::filesystem::path& slot_dir);

// The version word of the state file at `path` (its first 8 bytes), EINVAL naming the file
// for a short file, another magic or an unknown version, the errno of open/read otherwise.
Result<uint32_t> read_state_file_version(const std::filesystem::path& path);

}  // namespace kvshare::route
