// The broker side of share/adopt (what the router, kvshare-serve, links): listen first,
// let the caller ask the decoder for the share over HTTP, receive the fds, hand them to a
// provider process as inherited descriptors, wait for it, clean up.
//
//   auto broker = ShareBroker::listen();                 // 1. listen
//   POST /slots/0?action=share {"socket": broker->socket_path()}   // 2. caller
//   auto share = broker->receive(timeout_ms);            // 3. fds
//   auto run = broker->run_provider(*share, argv_template, timeout_ms);  // 4. provider
//   POST /slots/0?action=adopt {"tokens": [...], "share_id": share->share_id}  // 5. caller
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kvshare/fd.h"
#include "kvshare/handshake/listener.h"
#include "kvshare/share/spawn.h"
#include "layout/error.h"
#include "layout/share_header.h"

namespace kvshare {

struct ReceivedShare {
  uint64_t share_id = 0;
  uint32_t stream = 0;  // the KV stream handed over (checked: < n_stream)
  // The cells of `stream` handed over: prompt position p goes into cell first_cell + p,
  // p < n_cells (checked: within every KV cache's kv_size). n_cells 0 (first_cell then 0):
  // the message named no range, the whole stream.
  uint32_t first_cell = 0;
  uint32_t n_cells = 0;
  handshake::PeerCredentials peer;
  layout::ShareHeader header;               // parsed and validated
  bool header_was_known = false;            // its bytes were the last validated header's: not parsed again
  std::vector<handshake::FdEntry> entries;  // one per fd
  std::vector<Fd> fds;                      // checked: kind and size match the layout
};

// Substitutes "{layout}" and "{fds}" (and "{fd_offsets}") in `argv_template`, e.g.
// {"kvshare-prefill", "--tokens", "ids.txt", "--layout", "{layout}", "--fds", "{fds}"}.
// EINVAL when {layout} or {fds} is missing, or when an fd has a non-zero offset and the
// template has no {fd_offsets}.
Result<std::vector<std::string>> expand_provider_argv(const std::vector<std::string>& argv_template,
                                                      const std::string& layout_path,
                                                      const std::vector<handshake::FdEntry>& entries);

// A share message and its fds as a decoder sent them, checked as ShareBroker::receive checks
// them: the header parsed and validated (in full: no remembered header), the stream one the
// memory has (EINVAL naming field "stream" past n_stream), the range within every KV
// cache's kv_size (EINVAL naming field "first_cell" or "n_cells"), the fds exactly the layout's
// chunks (count, sizes, hashes, fd kind and size). A resident provider checks the
// region serve forwards to it so (kvshare/share/provider_channel.h). `what` names the
// sender in errors ("kvshare-serve (pid 4121)": "handshake from kvshare-serve (pid 4121): ..."). Every fd is closed on
// a failure.
Result<ReceivedShare> check_share_message(handshake::Message message, std::vector<Fd> fds,
                                          const handshake::PeerCredentials& peer, std::string_view what);

// What makes a share's region the same region as an earlier one: the same files (device and
// inode of each fd) at the same offsets and sizes, laid out the same. A decoder that
// re-exports (a restart, a new cache after a resume) sends other files. Whoever keeps a
// mapping across shares (the remote receiver, a resident provider) maps again on a change.
using RegionKey = std::vector<std::tuple<dev_t, ino_t, uint64_t, uint64_t, uint64_t>>;
Result<RegionKey> region_key(const ReceivedShare& share);

class ShareBroker {
 public:
  // Creates the private directory and the listening socket (see handshake::Listener) and
  // starts receiving at once, on a thread of its own: the decoder sends its message while
  // it answers the share request, so a frame larger than the socket buffer would wait,
  // and time out, for a reader that only started after that answer.
  static Result<ShareBroker> listen(const std::filesystem::path& parent = {});
  // The same on a socket named `socket_name` in `private_dir`, a 0700 directory of this
  // uid's that the caller keeps (handshake::Listener::create_in): the broker removes only
  // its socket and the provider's header file.
  static Result<ShareBroker> listen_in(const std::filesystem::path& private_dir, const std::string& socket_name);

  ShareBroker(ShareBroker&& other) noexcept;
  ShareBroker& operator=(ShareBroker&&) = delete;
  // Stops the receiving thread (cancelled, joined), closes every fd it took, then
  // removes the socket and directory.
  ~ShareBroker();

  const std::string& socket_path() const;
  const std::filesystem::path& directory() const;

  // The result of receiving, waiting at most `timeout_ms` more for it: accepts the decoder
  // (same uid or root), receives its message, parses the layout header and checks every fd
  // against it (count, chunk sizes and hashes, fd kind and size). A decoder's refusal is
  // ENOTSUP carrying its reason; a mismatch is EINVAL naming the field; ETIMEDOUT says how
  // far the message had come. Every fd is closed on every failure. A second call receives
  // the next connection in the caller's thread.
  Result<ReceivedShare> receive(int timeout_ms);
  // Drops the process-wide memory of the last validated header (receive() then parses the
  // next one in full): for tests and the benchmark's first-handoff figure.
  static void forget_known_header();

  // Writes share.header (layout::to_json, the same document the decoder sent, re-emitted
  // from the validated values) to "layout-<share_id>.json" (0600) in the private directory.
  Result<std::filesystem::path> write_header_file(const ReceivedShare& share);

  // Writes the header file, starts the provider from `argv_template` with the share's
  // fds at 3, 4, ... and nothing else inherited (kvshare/share/spawn.h), its stdout and
  // stderr captured, waits at most `timeout_ms` (then kills its process group), removes
  // the header file and returns what the provider did. A provider that exits non-zero,
  // is killed or times out is reported in the result, not as an error.
  Result<Finished> run_provider(const ReceivedShare& share, const std::vector<std::string>& argv_template,
                                int timeout_ms);

 private:
  struct State;
  explicit ShareBroker(std::unique_ptr<State> state);
  static Result<ShareBroker> start_receiving(handshake::Listener listener);
  std::unique_ptr<State> state_;  // on the heap: the receiving thread keeps its address
};

}  // namespace kvshare
