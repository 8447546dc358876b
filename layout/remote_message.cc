#include "layout/remote_message.h"

#include <cerrno>

namespace kvshare::layout {
namespace {

// Offsets: magic u32 @0, version u16 @4, kind u16 @6, share_id u64 @8, then per kind:
//   write: chunk u32 @16, reserved u32 @20 (0), offset u64 @24, size u64 @32
//   done:  n_tokens u32 @16, reserved u32 @20 (0), bytes u64 @24, layout_hash u64 @32
// and for both the secret, 16 bytes @40 (as drawn: no byte order). Version 1 was the
// first 40 bytes alone.
constexpr size_t kSecretAt = 40;
// Magic, version and kind: enough to name a header of another version before its size.
constexpr size_t kPrologueBytes = 8;

template <class T>
void put(RemoteHeaderBytes& out, size_t at, T value) {
  for (size_t i = 0; i < sizeof(T); ++i)
    out[at + i] = static_cast<std::byte>((static_cast<uint64_t>(value) >> (8 * i)) & 0xff);
}

template <class T>
T get(std::span<const std::byte> in, size_t at) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<uint64_t>(in[at + i]) << (8 * i);
  return static_cast<T>(v);
}

RemoteHeaderBytes prologue(RemoteKind kind, uint64_t share_id, const RemoteSecret& secret) {
  RemoteHeaderBytes out{};
  put<uint32_t>(out, 0, kRemoteMagic);
  put<uint16_t>(out, 4, kRemoteVersion);
  put<uint16_t>(out, 6, static_cast<uint16_t>(kind));
  put<uint64_t>(out, 8, share_id);
  for (size_t i = 0; i < secret.size(); ++i) out[kSecretAt + i] = secret[i];
  return out;
}

RemoteSecret secret_of(std::span<const std::byte> in) {
  RemoteSecret secret;
  for (size_t i = 0; i < secret.size(); ++i) secret[i] = in[kSecretAt + i];
  return secret;
}

Result<void> check_prologue(std::span<const std::byte> in, RemoteKind kind) {
  const char* name = kind == RemoteKind::write ? "write" : "completion";
  if (in.size() < kPrologueBytes)
    return fail(EPROTO, "remote {} header: {} bytes, expected {}", name, in.size(), kRemoteHeaderBytes);
  if (get<uint32_t>(in, 0) != kRemoteMagic)
    return fail(EPROTO, "remote {} header: magic {:#010x} at offset 0, expected {:#010x}", name, get<uint32_t>(in, 0),
                kRemoteMagic);
  const uint16_t version = get<uint16_t>(in, 4);
  if (version == 1)
    return fail(EPROTO,
                "remote {} header: version 1 at offset 4, this decoder speaks version {} (version 2 carries "
                "the share secret; update the provider)",
                name, kRemoteVersion);
  if (version != kRemoteVersion)
    return fail(EPROTO, "remote {} header: version {} at offset 4, this decoder speaks version {}", name, version,
                kRemoteVersion);
  if (in.size() != kRemoteHeaderBytes)
    return fail(EPROTO, "remote {} header: {} bytes, expected {}", name, in.size(), kRemoteHeaderBytes);
  if (get<uint16_t>(in, 6) != static_cast<uint16_t>(kind))
    return fail(EPROTO, "remote {} header: kind {} at offset 6, expected {}", name, get<uint16_t>(in, 6),
                static_cast<uint16_t>(kind));
  if (get<uint32_t>(in, 20) != 0)
    return fail(EPROTO, "remote {} header: reserved field at offset 20 is {:#x}, must be 0", name,
                get<uint32_t>(in, 20));
  return {};
}

}  // namespace

bool same_secret(const RemoteSecret& a, const RemoteSecret& b) {
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

RemoteHeaderBytes encode(const RemoteWrite& write) {
  RemoteHeaderBytes out = prologue(RemoteKind::write, write.share_id, write.secret);
  put<uint32_t>(out, 16, write.chunk);
  put<uint64_t>(out, 24, write.offset);
  put<uint64_t>(out, 32, write.size_bytes);
  return out;
}

RemoteHeaderBytes encode(const RemoteDone& done) {
  RemoteHeaderBytes out = prologue(RemoteKind::done, done.share_id, done.secret);
  put<uint32_t>(out, 16, done.n_tokens);
  put<uint64_t>(out, 24, done.bytes);
  put<uint64_t>(out, 32, done.layout_hash);
  return out;
}

Result<RemoteWrite> decode_remote_write(std::span<const std::byte> in) {
  if (auto ok = check_prologue(in, RemoteKind::write); !ok) return fail(ok.error());
  return RemoteWrite{get<uint64_t>(in, 8), secret_of(in), get<uint32_t>(in, 16), get<uint64_t>(in, 24),
                     get<uint64_t>(in, 32)};
}

Result<RemoteDone> decode_remote_done(std::span<const std::byte> in) {
  if (auto ok = check_prologue(in, RemoteKind::done); !ok) return fail(ok.error());
  return RemoteDone{get<uint64_t>(in, 8), secret_of(in), get<uint32_t>(in, 16), get<uint64_t>(in, 24),
                    get<uint64_t>(in, 32)};
}

}  // namespace kvshare::layout
