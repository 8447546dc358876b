// The resident provider protocol: what kvshare-serve says to a prefill provider that stays
// up across requests (the model loaded, the device open, the decoder's region mapped once),
// and what the provider answers. docs/provider.md ("The resident provider") is the
// specification; tests/data/provider-*.json are its vectors.
//
// One request, one reply, each a JSON object in one frame (a u32 little-endian length, then
// the UTF-8 JSON: handshake::length_prefixed) on an AF_UNIX SOCK_STREAM socket whose peer
// runs as our uid (or root), checked with SO_PEERCRED by both ends. Only serve's `region`
// request carries fds (SCM_RIGHTS on its first byte); any other frame with fds is refused.
//
//   provider -> serve   hello    unasked, first: {"kvshare_provider":1,"op":"hello","ok":true,"pid":..,
//                                "routes":["shared","file"],"cached":true}
//   serve -> provider   region   {"kvshare_provider":1,"op":"region","region_id":G,"share":<handshake share>}
//                                + the share's fds: the decoder's region, to map and keep until the next
//                                region (or the channel closes)
//   serve -> provider   prefill  {"kvshare_provider":1,"op":"prefill","route":"shared","region_id":G,
//                                "share_id":S,"stream":T[,"first_cell":C,"n_cells":N],"n_cached":P,
//                                "tokens":[..]}
//                             or {"kvshare_provider":1,"op":"prefill","route":"file","state_file":PATH,
//                                "state_version":V,"kv":{"n_ctx":..,"type_k":..,"type_v":..,"flash_attn":..},
//                                "tokens":[..]}
//   provider -> serve   reply    {"kvshare_provider":1,"op":"region"|"prefill","ok":true,...} or
//                                {"kvshare_provider":1,"op":..,"ok":false,"errno":E,"error":"..."};
//                                a prefill naming a region_id the provider does not hold is ESTALE:
//                                serve sends the region again and asks once more.
//
// Pure: encoding, parsing and the rules a request must meet before a provider's engine sees
// it; kvshare/share/provider_channel.h moves the frames.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvshare/handshake/message.h"
#include "layout/error.h"

namespace kvshare {

inline constexpr uint32_t kProviderProtocolVersion = 1;
// A region request carries the decoder's layout header (tens of KiB for a large model) and a
// prefill request a prompt's ids (32768 ids are ~200 KiB of JSON): 16 MiB leaves room for a
// 1M-token context.
inline constexpr uint32_t kMaxProviderMessageBytes = 16u << 20;
// The region's layout header is the deepest part of any message.
inline constexpr int kMaxProviderMessageDepth = 32;

enum class ProviderOp { hello, region, prefill };
std::string_view provider_op_name(ProviderOp op);

enum class PrefillRoute { shared, file };
std::string_view prefill_route_name(PrefillRoute route);

// The KV params a file-route prefill writes its state file with (llama-server's -c, -ctk,
// -ctv, -fa of the decoder); the shared route takes them from the region's header.
struct ProviderKvParams {
  uint32_t n_ctx = 0;
  std::string type_k = "f16";
  std::string type_v = "f16";
  bool flash_attn = true;
  // The decoder's slots (-np) and -kvu: a state file carries one KV stream per stream of the
  // cache it is restored into. Encoded only when n_seq_max > 1; absent parses as 1, unified.
  uint32_t n_seq_max = 1;
  bool kv_unified = true;
  friend bool operator==(const ProviderKvParams&, const ProviderKvParams&) = default;
};

struct ProviderRequest {
  ProviderOp op = ProviderOp::prefill;
  uint64_t region_id = 0;  // region, prefill(shared): serve's number for the region, from 1
  // region: the decoder's share message as the broker received and checked it (its fds ride
  // in SCM_RIGHTS, in its "fds" order). encode_provider_request splices `share.header_json`
  // when set, else dumps `share.header`.
  handshake::Message share;
  // prefill
  PrefillRoute route = PrefillRoute::shared;
  uint64_t share_id = 0;  // shared: the decoder's share the cells are written for
  // shared: the KV stream (the decoder's slot) whose cells are written; always encoded,
  // absent parses as 0. Checked against the region's n_stream by the provider, not here.
  uint32_t stream = 0;
  // shared: the run of cells of `stream` the share named (a unified cache of several
  // slots): id p goes into cell first_cell + p, p < n_cells. Encoded only when n_cells > 0;
  // absent parses as 0, 0: the whole stream. Checked against the region by the provider.
  uint32_t first_cell = 0;
  uint32_t n_cells = 0;
  uint32_t n_cached = 0;        // shared: cells 0..P-1 already hold ids 0..P-1 (docs/provider.md --cached)
  std::vector<int32_t> tokens;  // the handoff's ids (the prompt less its last token), at least 1
  std::string state_file;       // file: the absolute path to write (serve removes it after the restore)
  uint32_t state_version = 0;   // file: the decoder's LLAMA_STATE_SEQ_VERSION (0: the provider's latest)
  ProviderKvParams kv;          // file
};

struct ProviderReply {
  ProviderOp op = ProviderOp::hello;
  bool ok = true;
  int error_errno = 0;  // !ok: what failed, as errno (ESTALE: not the region held)
  std::string error;    // !ok: a sentence naming what failed
  // hello
  uint64_t pid = 0;
  bool takes_shared = true;  // "routes" holds "shared"
  bool takes_file = true;    // "routes" holds "file"
  bool takes_cached = true;  // n_cached > 0 is understood
  // region
  uint64_t region_id = 0;
  double region_ms = 0;  // mapping (and for an NPU, importing) the region
  // prefill
  double prefill_ms = 0;     // the provider's own figure: the forward pass and the writes
  uint32_t n_prefilled = 0;  // ids computed and written (tokens less n_cached)
};

// The compact JSON of a request or reply (keys in the documented order).
std::string encode_provider_request(const ProviderRequest& request);
std::string encode_provider_reply(const ProviderReply& reply);

// Parse and check one message. Errors name `source` and the field: EINVAL for a bad field,
// EMSGSIZE past kMaxProviderMessageBytes, EPROTO for another protocol version. The size and
// nesting are bounded before parsing. A region request's share is checked as a handshake
// message (handshake::parse_message_object), not yet against its fds. Never throws.
Result<ProviderRequest> parse_provider_request(std::string_view text, std::string_view source);
Result<ProviderReply> parse_provider_reply(std::string_view text, std::string_view source);

// Whether a provider that said `hello` and holds region `held_region_id` (0: none) hands a
// prefill request to its engine or answers it itself: ENOTSUP for a route the hello did not
// offer, and for n_cached > 0 after "cached": false; ESTALE for a shared-route prefill
// naming any region but the one held (the last region the provider answered ok: none before
// the first, after a refused region and after the channel ended), so serve sends the region
// again. The message is the reply's "error". The stream and cells against the region held
// are check_cells_in_memory's (kvshare/share/decoder_share.h).
Result<void> check_prefill_admitted(const ProviderReply& hello, uint64_t held_region_id,
                                    const ProviderRequest& request);

}  // namespace kvshare
