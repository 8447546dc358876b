// The two active-message headers of the remote route (docs/remote.md, "Messages"): a
// write (share_id, secret, chunk, offset, length: the data follows as the message's
// payload) and the completion (share_id, secret, n_tokens, bytes, whole-layout hash).
// 56 bytes each, little-endian, fixed layout (version 2; version 1, 40 bytes without the
// secret, is refused by name); decoding refuses anything else with a message naming the
// field, so a peer's garbage is an error, never a guess.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

#include "layout/error.h"

namespace kvshare::layout {

inline constexpr uint32_t kRemoteMagic = 0x5752564b;  // "KVRW" read as little-endian bytes
inline constexpr uint16_t kRemoteVersion = 2;
inline constexpr size_t kRemoteHeaderBytes = 56;
inline constexpr size_t kRemoteSecretBytes = 16;

enum class RemoteKind : uint16_t { write = 1, done = 2 };

// The share's 128 random bits, drawn by the decoder with the share_id and given only in
// the offer: a peer that saw or guessed a share_id cannot forge a message without it.
using RemoteSecret = std::array<std::byte, kRemoteSecretBytes>;

// Whether two secrets are equal, looking at every byte whatever they hold: the time a
// wrong secret takes does not say how many of its leading bytes were right.
bool same_secret(const RemoteSecret& a, const RemoteSecret& b);

struct RemoteWrite {
  uint64_t share_id = 0;
  RemoteSecret secret{};  // the offer's
  uint32_t chunk = 0;
  uint64_t offset = 0;      // byte offset in the chunk
  uint64_t size_bytes = 0;  // must equal the payload's length
};

struct RemoteDone {
  uint64_t share_id = 0;
  RemoteSecret secret{};     // the offer's
  uint32_t n_tokens = 0;     // cells 0..n_tokens-1 written
  uint64_t bytes = 0;        // payload bytes the provider sent and saw accepted
  uint64_t layout_hash = 0;  // whole_layout_hash of the layout it wrote
};

using RemoteHeaderBytes = std::array<std::byte, kRemoteHeaderBytes>;

RemoteHeaderBytes encode(const RemoteWrite& write);
RemoteHeaderBytes encode(const RemoteDone& done);

// EPROTO naming the field: a size other than 56, a bad magic, another version (version 1
// is named: it has no secret), another kind than asked for, a reserved field that is not
// zero. The secret is not judged here: only the receiver knows the open share's.
Result<RemoteWrite> decode_remote_write(std::span<const std::byte> header);
Result<RemoteDone> decode_remote_done(std::span<const std::byte> header);

}  // namespace kvshare::layout
