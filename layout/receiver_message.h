// The remote receiver's control channel: what kvshare-serve asks the kvshare-remote-receiver
// process it supervises, and what the receiver answers. One request, one reply, each a JSON
// object in one length-prefixed frame (kvshare/handshake length_prefixed) on the socket pair
// serve hands the receiver at start. No fd ever rides on this channel: the decoder's region
// reaches the receiver through the ordinary share handshake (docs/protocol.md), with every
// check of that route. docs/remote.md ("The receiver process") is the specification;
// tests/data/receiver-*.json are its vectors. Pure: encoding and parsing only.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "layout/error.h"

namespace kvshare::layout {

// 2: several listens and grants at once (one per slot): grant names its listen "socket" and
// the positions the decoder keeps ("n_cached"); revoke names a "grant_id" and/or a
// "socket" (neither: everything). The offer a grant returns is version 3.
inline constexpr uint32_t kReceiverProtocolVersion = 2;
// A reply carries the offer and with it the decoder's layout header (tens of KiB for a
// large model); 4 MiB leaves room for any header the share handshake itself accepts.
inline constexpr uint32_t kMaxReceiverMessageBytes = 4u << 20;
// The offer's layout header is the deepest part of any message.
inline constexpr int kMaxReceiverMessageDepth = 24;

enum class ReceiverOp {
  hello,     // the receiver's first frame, unasked: it is up and speaks this version
  listen,    // open a share socket in the receiver's private directory for the decoder to connect to
  grant,     // take the decoder's share from that socket, map it (once per region), grant n_cells
  complete,  // the adopt check: the provider's completion matches what was granted and received
  revoke,    // no write of the named grant lands from now on (waits for its receives); drops the named listen
};
std::string_view receiver_op_name(ReceiverOp op);

struct ReceiverRequest {
  ReceiverOp op = ReceiverOp::listen;
  // listen: a file name (no '/'), at most 100 bytes. grant: the listen socket whose share
  // it takes (several listens and grants may be open at once, one per slot). revoke: the
  // pending listen to drop, if any (empty: none; with grant_id 0 too: every listen and
  // every grant).
  std::string socket_name;
  // grant: the share's positions 0..n_cells-1 (the prompt less its last token), at least 1;
  // position p sits in cell first_cell + p of the share's stream (the decoder's share
  // message says which). The decoder keeps positions 0..n_cached-1 (it holds them), so the
  // grant covers positions n_cached..n_cells-1 only.
  uint32_t n_cells = 0;
  uint32_t n_cached = 0;
  uint64_t timeout_ms = 0;  // grant: the grant's lifetime, and the wait for the decoder's message
  uint64_t grant_id = 0;    // complete, revoke: the offer's share_id (revoke: 0 names no grant)
  uint32_t n_tokens = 0;    // complete
  std::string why;          // revoke: said on the receiver's stderr
};

struct ReceiverReply {
  ReceiverOp op = ReceiverOp::hello;
  bool ok = true;
  // !ok: what failed, as the receiver's Error has it.
  int error_errno = 0;
  std::string error;
  // hello
  uint64_t pid = 0;
  // listen: the socket's absolute path, for POST /slots/0?action=share {"socket": ...}
  std::string socket_path;
  // grant
  uint64_t share_id = 0;       // the decoder's share_id (its share message): what serve adopts
  nlohmann::json offer;        // the remote offer (kvshare/remote/remote_offer.h), for the provider
  bool region_mapped = false;  // this share brought a region the receiver had not mapped: mapped and registered now
  double region_ms = 0;        // the receive, and for a new region its mapping and registration
  // complete
  uint64_t bytes_received = 0;
};

// The compact JSON of a request or reply (keys in the documented order).
std::string encode_receiver_request(const ReceiverRequest& request);
std::string encode_receiver_reply(const ReceiverReply& reply);

// Parse and check one message (EINVAL naming `source` and the field; EMSGSIZE past
// kMaxReceiverMessageBytes; EPROTO for another protocol version). The size and the nesting
// are bounded before parsing. Never throws.
Result<ReceiverRequest> parse_receiver_request(std::string_view text, std::string_view source);
Result<ReceiverReply> parse_receiver_reply(std::string_view text, std::string_view source);

}  // namespace kvshare::layout
