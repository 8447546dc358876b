// The handshake message: what a decoder sends a broker with its KV fds, or what either
// side sends to refuse. docs/protocol.md is its specification; tests/data/handshake-*.bin
// are its vectors.
//
// Frame: a little-endian u32 length, then that many bytes of UTF-8 JSON (at most
// kMaxMessageBytes). The fds, one per share_layout chunk in chunk order, ride in
// SCM_RIGHTS on the first sendmsg of the frame.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "layout/error.h"

namespace kvshare::handshake {

inline constexpr uint32_t kProtocolVersion = 1;
inline constexpr uint32_t kMaxMessageBytes = 1u << 20;  // 1 MiB: a header is a few KiB
inline constexpr size_t kMaxFds = 253;                  // SCM_MAX_FD (include/net/scm.h)
inline constexpr size_t kLengthBytes = 4;

enum class MessageType : uint8_t { share, refuse };
std::string_view message_type_name(MessageType type);

// One fd of a share message, in fd order.
struct FdEntry {
  uint32_t chunk = 0;        // = its position in the fd list
  std::string kind;          // export backend: "memfd", "udmabuf", "dmaheap", "device"
  uint64_t offset = 0;       // where the chunk starts inside the fd (page-aligned)
  uint64_t size_bytes = 0;   // the chunk's size (= the layout's)
  uint64_t layout_hash = 0;  // the chunk's share_layout hash (= the layout's)
  friend bool operator==(const FdEntry&, const FdEntry&) = default;
};

struct Message {
  uint32_t version = kProtocolVersion;
  MessageType type = MessageType::share;
  uint64_t share_id = 0;  // share: fresh per share; refuse: the share refused (0: none)
  // share only:
  // The KV stream whose cells the share hands over (slot s of llama-server -np N without
  // --kv-unified). Always written; a message without it (an older decoder) reads as 0.
  uint32_t stream = 0;
  // The run of cells of `stream` the share hands over (a unified cache of several slots:
  // the cells the decoder reserved for the sequence): prompt position p goes into cell
  // first_cell + p, for p < n_cells. Written only when n_cells > 0; absent reads as 0,
  // 0: no range, the whole stream. Checked against the header by check_share_message.
  uint32_t first_cell = 0;
  uint32_t n_cells = 0;
  std::vector<FdEntry> fds;  // exactly the SCM_RIGHTS fds, same order
  // The layout header (docs/layout.md). A sender sets `header_json` to its compact text
  // (layout::to_json), spliced into the message verbatim: a decoder serializes its header
  // once at start, not per share. A parsed message has the object in `header` (the JSON
  // is parsed once per handshake; layout::parse_share_header takes it as it is) and an
  // empty `header_json`. encode_json uses `header_json` when set, else `header`.
  std::string header_json;
  nlohmann::ordered_json header;
  // Set by parse_json instead of `header` when the message's header is, byte for byte, the
  // `known_header` text the caller passed (a header it validated before).
  bool header_is_known = false;
  // refuse only:
  std::string field;   // the JSON field that differs ("params.type_k"), "" if none
  std::string reason;  // a sentence a human acts on
};

// The JSON text of `message` (compact, keys in the documented order).
std::string encode_json(const Message& message);
// `body` behind its u32 little-endian length (the caller bounds the size): the framing every
// message on our AF_UNIX sockets uses, the handshake's and the remote receiver's.
std::vector<std::byte> length_prefixed(std::string_view body);
// Length prefix + JSON. Fails with EMSGSIZE past kMaxMessageBytes.
Result<std::vector<std::byte>> encode_frame(const Message& message);

// Parses and validates the JSON of one message: version (a newer one is refused by
// name), type, share_id, and for share the stream (u32, absent = 0; not checked against
// the header here: check_share_message does), the fds (chunks 0..n-1 in order, known kinds,
// positive sizes, at most kMaxFds) and a header object. Does NOT interpret the header:
// layout::parse_share_header does that. Errors name `source` and the field.
//
// `known_header`: the compact text of a header the caller already validated (the broker's
// last one; a decoder sends the same 20-40 KB header on every share). When the message
// ends with `,"header":` + exactly that text + `}`, only the envelope before it is parsed
// (it must be a whole object without a "header" key of its own) and `header_is_known` is
// set: the header is neither parsed nor checked again. Anything else is parsed in full.
Result<Message> parse_json(std::string_view json, std::string_view source, std::string_view known_header = {});
// Checks one message already parsed as JSON, as parse_json does after parsing: the resident
// provider protocol's region request carries the decoder's share message as its "share"
// object (kvshare/share/provider_protocol.h). The caller bounded the size and nesting. The
// header is moved out of `json`.
Result<Message> parse_message_object(nlohmann::ordered_json& json, std::string_view source);
// The whole frame (prefix + JSON, nothing after): for vectors and the fuzzer.
Result<Message> parse_frame(std::span<const std::byte> frame, std::string_view source,
                            std::string_view known_header = {});

// A refusal naming the field that differs.
Message make_refusal(uint64_t share_id, std::string field, std::string reason);

}  // namespace kvshare::handshake
