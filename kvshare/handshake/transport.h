// Sending and receiving one handshake frame with its fds on an AF_UNIX SOCK_STREAM socket.
#pragma once

#include <sys/types.h>

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvshare/fd.h"
#include "kvshare/handshake/message.h"
#include "layout/error.h"

namespace kvshare::handshake {

struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

// SO_PEERCRED of a connected socket (borrowed): who was on the other end at connect().
Result<PeerCredentials> peer_credentials(int socket_fd);

// Refuses (EPERM) a peer that is neither `our_uid` nor root, naming its pid and uid.
Result<void> check_peer_allowed(const PeerCredentials& peer, uid_t our_uid);

// Connects to the broker's socket at `path`. Close-on-exec; blocks at most `timeout_ms`.
// Fails with ENOENT/ECONNREFUSED when nobody listens, ENAMETOOLONG past sun_path.
// Checks nothing about who listens: a sender of KV fds uses connect_checked_listener.
Result<Fd> connect_unix(const std::string& path, int timeout_ms);

// A directory a share socket may live in: one of `our_uid`'s, not a symbolic link, that no
// group or other user can reach (mode 0700 or stricter). EPERM (or the open's errno) with
// a message that starts with `what` and names the directory and what is wrong.
Result<void> check_private_directory(const std::string& directory, uid_t our_uid, std::string_view what);

// The one way a decoder reaches a broker before it sends any fd of its KV cache. Before
// connecting, `path` must be absolute, hold no NUL byte (a leading NUL is the abstract
// namespace, which has no permissions), not be a symbolic link but a socket, and sit in a
// directory (itself not a symbolic link) owned by this process's effective uid with no
// group or other access (the broker's 0700 directory): so no other uid can have bound or
// reach it. After connecting, SO_PEERCRED must show the listener runs as our uid or root,
// which holds even if the path was swapped between the checks and the connect. Blocks at
// most `timeout_ms`. Fails with EPERM (any trust check; the message names the path and
// what is wrong), ENOTSOCK, or connect_unix's errors; nothing has been sent on a failure.
Result<Fd> connect_checked_listener(const std::string& path, int timeout_ms);

// `path` as a message can show it: a NUL as \0 and other control bytes as \xNN, so an
// abstract-namespace path is visible as one.
std::string printable_path(std::string_view path);

// Sends `frame` (a u32 little-endian length prefix and its body, as encode_frame or
// length_prefixed makes it) on the stream socket `socket_fd` (borrowed), with `fds`
// (borrowed: the kernel passes duplicates) in SCM_RIGHTS on the first sendmsg. Resumes short
// sends, retries EINTR, waits (poll) on EAGAIN; blocks at most `timeout_ms`. `what` names
// the frame in errors ("handshake", "remote receiver request"). EINVAL past kMaxFds fds,
// EPIPE if the peer left, ETIMEDOUT.
Result<void> send_frame(int socket_fd, std::span<const std::byte> frame, std::span<const int> fds, int timeout_ms,
                        std::string_view what);

// Sends `message` as one frame on `socket_fd` (borrowed), with `fds` (borrowed: the
// kernel passes duplicates; ours stay open) in SCM_RIGHTS on the first sendmsg, which
// always carries the length prefix. Resumes short sends; retries EINTR; waits (poll) on
// EAGAIN. Blocks at most `timeout_ms`. Fails with EINVAL past kMaxFds fds or when the fd
// count differs from message.fds, EMSGSIZE past kMaxMessageBytes, EPIPE if the peer left,
// ETIMEDOUT.
Result<void> send_message(int socket_fd, const Message& message, std::span<const int> fds, int timeout_ms);

struct ReceivedMessage {
  Message message;
  std::vector<Fd> fds;  // in SCM_RIGHTS order = message.fds order
};

struct ReceivedFrame {
  std::vector<std::byte> body;  // the bytes after the length prefix
  std::vector<Fd> fds;          // whatever SCM_RIGHTS brought with the first bytes
};

// Receives one length-prefixed frame (at most `max_bytes` of body) from `socket_fd`
// (borrowed) with MSG_CMSG_CLOEXEC; every fd that arrives becomes an Fd at once. The
// errors of receive_message below, with `what` naming the frame; the body is not parsed.
Result<ReceivedFrame> receive_frame(int socket_fd, int timeout_ms, std::string_view peer, int cancel_fd = -1,
                                    std::string_view what = "handshake", uint32_t max_bytes = kMaxMessageBytes);

// Receives one frame from `socket_fd` (borrowed) with MSG_CMSG_CLOEXEC. Every fd that
// arrives becomes an Fd before a byte of JSON is parsed, so each error closes them all.
// Errors (all naming `peer`): EPROTO for control data truncated (MSG_CTRUNC), fds arriving
// after the first read, a short read (the peer closed mid-frame, with the offset reached),
// more or fewer fds than the JSON declares or any past kMaxFds; EMSGSIZE for a length
// over kMaxMessageBytes; ETIMEDOUT after `timeout_ms`; parse errors from parse_json.
// `known_header`: see parse_json. `cancel_fd` (borrowed, -1: none): once it is readable
// the wait ends with ECANCELED, naming the bytes read so far.
Result<ReceivedMessage> receive_message(int socket_fd, int timeout_ms, std::string_view peer,
                                        std::string_view known_header = {}, int cancel_fd = -1);

}  // namespace kvshare::handshake
