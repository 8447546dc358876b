// The two active-message headers of the remote route (docs/remote.md, "Messages"): a
// write (share_id, chunk, offset, length: the data follows as the message's payload) and
// the completion (share_id, n_tokens, bytes, whole-layout hash). 40 bytes each,
// little-endian, fixed layout; decoding refuses anything else with a message naming the
// field, so a peer's garbage is an error, never a guess.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

#include "layout/error.h"

namespace kvshare::layout {

inline constexpr uint32_t kRemoteMagic = 0x5752564b;  // "KVRW" read as little-endian bytes
inline constexpr uint16_t kRemoteVersion = 1;
inline constexpr size_t kRemoteHeaderBytes = 40;

enum class RemoteKind : uint16_t { write = 1, done = 2 };

struct RemoteWrite {
  uint64_t share_id = 0;
  uint32_t chunk = 0;
  uint64_t offset = 0;       // byte offset in the chunk
  uint64_t size_bytes = 0;   // must equal the payload's length
};

struct RemoteDone {
  uint64_t share_id = 0;
  uint32_t n_tokens = 0;     // cells 0..n_tokens-1 written
  uint64_t bytes = 0;        // payload bytes the provider sent and saw accepted
  uint64_t layout_hash = 0;  // whole_layout_hash of the layout it wrote
};

using RemoteHeaderBytes = std::array<std::byte, kRemoteHeaderBytes>;

RemoteHeaderBytes encode(const RemoteWrite& write);
RemoteHeaderBytes encode(const RemoteDone& done);

// EPROTO naming the field: a size other than 40, a bad magic, another version, another
// kind than asked for, a reserved field that is not zero.
Result<RemoteWrite> decode_remote_write(std::span<const std::byte> header);
Result<RemoteDone> decode_remote_done(std::span<const std::byte> header);

}  // namespace kvshare::layout
