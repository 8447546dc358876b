#include "kvshare/share/broker.h"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>

#include "kvshare/region/fd_inspect.h"
#include "kvshare/sys.h"
#include "layout/remote_grant.h"

namespace kvshare {
namespace {

bool replace_all(std::string& text, std::string_view from, const std::string& to) {
  bool found = false;
  for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size())) {
    text.replace(at, from.size(), to);
    found = true;
  }
  return found;
}

// The fds must be exactly the layout's chunks, and the stream one the memory has: a
// decoder and its header cannot disagree.
Result<void> check_entries(const ReceivedShare& share, std::string_view peer) {
  for (const auto& cache : share.header.memory.kv_caches) {
    if (share.stream >= cache.n_stream)
      return fail(EINVAL, "handshake from {}: field \"stream\" is {}, the header's \"{}\" KV cache has n_stream {}",
                  peer, share.stream, cache.role, cache.n_stream);
  }
  if (share.header.memory.kv_caches.empty() && share.stream != 0)
    return fail(EINVAL, "handshake from {}: field \"stream\" is {}, the header's memory has no KV cache (one stream)",
                peer, share.stream);
  if (share.n_cells == 0 && share.first_cell > 0)
    return fail(EINVAL,
                "handshake from {}: field \"n_cells\" is 0 with field \"first_cell\" {}: a range names "
                "its cells",
                peer, share.first_cell);
  if (share.n_cells > 0 && share.header.memory.kv_caches.empty())
    return fail(EINVAL, "handshake from {}: field \"n_cells\" is {}, the header's memory has no KV cache", peer,
                share.n_cells);
  for (const auto& cache : share.header.memory.kv_caches) {
    if (share.first_cell >= cache.kv_size && share.n_cells > 0)
      return fail(EINVAL,
                  "handshake from {}: field \"first_cell\" is {}, past the header's \"{}\" KV cache's "
                  "kv_size {}",
                  peer, share.first_cell, cache.role, cache.kv_size);
    if (uint64_t{share.first_cell} + share.n_cells > cache.kv_size)
      return fail(EINVAL,
                  "handshake from {}: field \"n_cells\" is {} from first_cell {}, past the header's \"{}\" "
                  "KV cache's kv_size {}",
                  peer, share.n_cells, share.first_cell, cache.role, cache.kv_size);
  }
  const auto& chunks = share.header.layout.chunks;
  if (share.entries.size() != chunks.size())
    return fail(EINVAL, "handshake from {}: field \"fds\" has {} entries, the header's layout has {} chunks", peer,
                share.entries.size(), chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    const auto& entry = share.entries[i];
    if (entry.size_bytes != chunks[i].size_bytes)
      return fail(EINVAL, "handshake from {}: field \"fds[{}].size_bytes\" is {}, the header says {}", peer, i,
                  entry.size_bytes, chunks[i].size_bytes);
    if (entry.layout_hash != chunks[i].layout_hash)
      return fail(EINVAL, "handshake from {}: field \"fds[{}].layout_hash\" is {:#018x}, the header says {:#018x}",
                  peer, i, entry.layout_hash, chunks[i].layout_hash);
    auto inspection = inspect_fd(share.fds[i].get(), entry.offset + entry.size_bytes,
                                 fmt::format("handshake from {}: fd {} (chunk {})", peer, share.fds[i].get(), i));
    if (!inspection) return fail(inspection.error());
  }
  return {};
}

}  // namespace

Result<std::vector<std::string>> expand_provider_argv(const std::vector<std::string>& argv_template,
                                                      const std::string& layout_path,
                                                      const std::vector<handshake::FdEntry>& entries) {
  std::string offsets;
  bool any_offset = false;
  for (size_t i = 0; i < entries.size(); ++i) {
    offsets += (i ? "," : "") + std::to_string(entries[i].offset);
    any_offset = any_offset || entries[i].offset != 0;
  }
  const std::string fds = inherited_fd_list(entries.size());
  bool has_layout = false, has_fds = false, has_offsets = false;
  std::vector<std::string> argv = argv_template;
  for (auto& arg : argv) {
    has_layout = replace_all(arg, "{layout}", layout_path) || has_layout;
    has_fds = replace_all(arg, "{fds}", fds) || has_fds;
    has_offsets = replace_all(arg, "{fd_offsets}", offsets) || has_offsets;
  }
  if (argv.empty() || !has_layout || !has_fds)
    return fail(EINVAL,
                "provider command template must contain {{layout}} and {{fds}} (e.g. --layout {{layout}} "
                "--fds {{fds}})");
  if (any_offset && !has_offsets)
    return fail(EINVAL,
                "the decoder's regions start at offsets {} inside their fds, and the provider command "
                "template has no {{fd_offsets}} to pass them",
                offsets);
  return argv;
}

namespace {

// The last layout header a handshake carried and passed every check, with its compact text
// (the form decoders send). A decoder sends the same header on every
// share, so the next handshake that carries these exact bytes skips parsing and checking
// it (handshake::parse_json's known_header). Process-wide: kvshare-serve makes a broker per
// request.
struct KnownHeader {
  std::string text;            // the parsed header dumped compactly: the bytes a decoder sends
  layout::ShareHeader header;  // parsed and checked
};

// Replaced whole, never changed in place: a receive() keeps the one it read.
std::mutex known_mutex;
std::shared_ptr<const KnownHeader> known_header;

}  // namespace

void ShareBroker::forget_known_header() {
  std::lock_guard lock(known_mutex);
  known_header.reset();
}

namespace {

// Accepts, receives and checks one share on `listener` within `timeout_ms`; ECANCELED once
// `cancel_fd` (-1: none) is readable.
Result<ReceivedShare> receive_share(handshake::Listener& listener, int timeout_ms, int cancel_fd) {
  std::shared_ptr<const KnownHeader> known;
  {
    std::lock_guard lock(known_mutex);
    known = known_header;
  }
  handshake::PeerCredentials peer;
  auto received = listener.accept_and_receive(timeout_ms, &peer, known ? std::string_view(known->text) : "", cancel_fd);
  if (!received) return fail(received.error());
  const std::string who = fmt::format("pid {}", peer.pid);
  if (received->message.type == handshake::MessageType::refuse) {
    const auto& message = received->message;
    return fail(ENOTSUP, "decoder {} refused share {}{}: {}", who, message.share_id,
                message.field.empty() ? std::string() : fmt::format(" (field \"{}\")", message.field), message.reason);
  }
  ReceivedShare share;
  share.share_id = received->message.share_id;
  share.stream = received->message.stream;
  share.first_cell = received->message.first_cell;
  share.n_cells = received->message.n_cells;
  share.peer = peer;
  share.entries = std::move(received->message.fds);
  share.fds = std::move(received->fds);
  if (received->message.header_is_known) {
    share.header = known->header;
    share.header_was_known = true;
  } else {
    auto header = layout::parse_share_header_document(received->message.header, fmt::format("handshake from {}", who));
    if (!header) return fail(header.error());
    share.header = std::move(*header);
    // The parsed object's compact dump: the bytes of any message header that parses to
    // this same object (nlohmann's parse and dump round-trip), i.e. what the decoder sent.
    auto remembered = std::make_shared<const KnownHeader>(KnownHeader{
        received->message.header.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace), share.header});
    std::lock_guard lock(known_mutex);
    known_header = std::move(remembered);
  }
  if (auto checked = check_entries(share, who); !checked) return fail(checked.error());
  return share;
}

}  // namespace

Result<ReceivedShare> check_share_message(handshake::Message message, std::vector<Fd> fds,
                                          const handshake::PeerCredentials& peer, std::string_view what) {
  if (message.type != handshake::MessageType::share)
    return fail(EINVAL, "handshake from {}: a refusal, not a share", what);
  ReceivedShare share;
  share.share_id = message.share_id;
  share.stream = message.stream;
  share.first_cell = message.first_cell;
  share.n_cells = message.n_cells;
  share.peer = peer;
  share.entries = std::move(message.fds);
  share.fds = std::move(fds);
  if (share.fds.size() != share.entries.size())
    return fail(EPROTO, "handshake from {}: {} fd(s) arrived, field \"fds\" lists {}", what, share.fds.size(),
                share.entries.size());
  auto header = layout::parse_share_header_document(message.header, fmt::format("handshake from {}", what));
  if (!header) return fail(header.error());
  share.header = std::move(*header);
  if (auto checked = check_entries(share, what); !checked) return fail(checked.error());
  return share;
}

Result<RegionKey> region_key(const ReceivedShare& share) {
  RegionKey key;
  const uint64_t hash = layout::whole_layout_hash(share.header.layout);
  for (size_t i = 0; i < share.fds.size(); ++i) {
    struct stat st {};
    if (::fstat(share.fds[i].get(), &st) != 0)
      return fail(errno, "fstat of the decoder's fd {} (chunk {})", share.fds[i].get(), i);
    key.emplace_back(st.st_dev, st.st_ino, share.entries[i].offset, share.entries[i].size_bytes, hash);
  }
  return key;
}

namespace {

// The receiving thread waits until cancelled: receive() bounds the caller's wait.
constexpr int kBackgroundReceiveMs = std::numeric_limits<int>::max();

}  // namespace

struct ShareBroker::State {
  explicit State(handshake::Listener l) : listener(std::move(l)) {}
  handshake::Listener listener;
  Fd cancel;           // eventfd: readable once the receiving thread must stop
  std::thread thread;  // the first receive, started by listen()
  std::mutex mutex;
  std::condition_variable finished;
  std::optional<Result<ReceivedShare>> result;  // the thread's, under `mutex`
  bool result_taken = false;                    // later receive() calls run in the caller

  void stop_thread() {
    if (!thread.joinable()) return;
    const uint64_t one = 1;
    // An eventfd write of 1 cannot block or fail short here: the counter is far from its limit.
    (void)!::write(cancel.get(), &one, sizeof one);
    thread.join();
  }
};

ShareBroker::ShareBroker(std::unique_ptr<State> state) : state_(std::move(state)) {}
ShareBroker::ShareBroker(ShareBroker&& other) noexcept = default;
ShareBroker::~ShareBroker() {
  if (state_) state_->stop_thread();
}

const std::string& ShareBroker::socket_path() const { return state_->listener.socket_path(); }
const std::filesystem::path& ShareBroker::directory() const { return state_->listener.directory(); }

Result<ShareBroker> ShareBroker::listen(const std::filesystem::path& parent) {
  auto listener = handshake::Listener::create(parent);
  if (!listener) return fail(listener.error());
  return start_receiving(std::move(*listener));
}

Result<ShareBroker> ShareBroker::listen_in(const std::filesystem::path& private_dir, const std::string& socket_name) {
  auto listener = handshake::Listener::create_in(private_dir, socket_name);
  if (!listener) return fail(listener.error());
  return start_receiving(std::move(*listener));
}

Result<ShareBroker> ShareBroker::start_receiving(handshake::Listener listener) {
  auto state = std::make_unique<State>(std::move(listener));
  state->cancel.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!state->cancel) return fail(errno, "eventfd to stop the receiver on {}", state->listener.socket_path());
  State* raw = state.get();
  try {
    state->thread = std::thread([raw] {
      auto received = receive_share(raw->listener, kBackgroundReceiveMs, raw->cancel.get());
      std::lock_guard lock(raw->mutex);
      raw->result = std::move(received);
      raw->finished.notify_all();
    });
  } catch (const std::system_error& e) {  // no thread to spare: no exception leaves kvshare
    return fail(e.code().value(), "starting the receiver thread for {}", state->listener.socket_path());
  }
  return ShareBroker(std::move(state));
}

Result<ReceivedShare> ShareBroker::receive(int timeout_ms) {
  State& state = *state_;
  if (state.result_taken) return receive_share(state.listener, timeout_ms, -1);
  {
    std::unique_lock lock(state.mutex);
    state.finished.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return state.result.has_value(); });
  }
  // Either it finished, or it is told to stop now and reports how far it had come.
  state.stop_thread();
  state.result_taken = true;
  Result<ReceivedShare> result = std::move(*state.result);
  state.result.reset();
  if (!result && result.error().errno_value() == ECANCELED)
    return fail(ETIMEDOUT, "no share within {} ms: {}", timeout_ms, result.error().message());
  return result;
}

Result<std::filesystem::path> ShareBroker::write_header_file(const ReceivedShare& share) {
  const auto path = directory() / fmt::format("layout-{}.json", share.share_id);
  const std::string text = layout::to_json(share.header, true);
  Fd fd(sys::ops().open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!fd) return fail(errno, "creating the provider's header file {}", path.string());
  size_t written = 0;
  while (written < text.size()) {
    const ssize_t n = sys::ops().write(fd.get(), text.data() + written, text.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = n < 0 ? errno : EIO;
      sys::ops().unlink(path.c_str());
      return fail(error, "writing the provider's header file {} at byte {} of {}", path.string(), written, text.size());
    }
    written += static_cast<size_t>(n);
  }
  return path;
}

Result<Finished> ShareBroker::run_provider(const ReceivedShare& share, const std::vector<std::string>& argv_template,
                                           int timeout_ms) {
  auto path = write_header_file(share);
  if (!path) return fail(path.error());
  // The header file goes on every path out of here.
  struct Unlink {
    std::string path;
    ~Unlink() { sys::ops().unlink(path.c_str()); }
  } unlink_header{path->string()};
  auto argv = expand_provider_argv(argv_template, path->string(), share.entries);
  if (!argv) return fail(argv.error());
  std::vector<int> fds;
  for (const auto& fd : share.fds) fds.push_back(fd.get());
  SpawnOptions options;
  options.inherit_fds = inherit_in_order(fds);
  options.capture_stdout = true;
  options.capture_stderr = true;
  auto result = run_child(*argv, options, std::chrono::milliseconds(timeout_ms));
  if (!result) return fail(result.error().with_context(fmt::format("share {}", share.share_id)));
  return result;
}

}  // namespace kvshare
