#include "kvshare/remote/receiver_service.h"

#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kvshare/handshake/message.h"
#include "kvshare/handshake/transport.h"
#include "kvshare/region/importer.h"
#include "kvshare/remote/remote_receiver.h"
#include "kvshare/share/broker.h"
#include "layout/receiver_message.h"
#include "layout/remote_grant.h"

namespace kvshare::remote {
namespace {

using layout::ReceiverOp;
using layout::ReceiverReply;
using layout::ReceiverRequest;

constexpr std::string_view kPeer = "kvshare-serve";
// serve sends a request as one small frame: once its first byte is here the rest follows.
constexpr int kFrameTimeoutMs = 10000;
// serve asks for the grant after the decoder answered its share request, and the decoder
// sends its message while it answers: this bounds a decoder that answered and never sent.
constexpr int kShareMessageTimeoutMs = 30000;
constexpr int kReplyTimeoutMs = 10000;

void say(const std::string& line) {
  std::fprintf(stderr, "kvshare-remote-receiver: %s\n", line.c_str());
  std::fflush(stderr);
}

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

// The decoder's region as this process holds it: its own mappings of the fds the decoder
// shared, and the UCX receiver registered over them once.
struct Region {
  RegionKey key;
  layout::ShareHeader header;
  ImportedShare imported;
  // Members go in reverse order: the CPU-access guards, then the receiver (its progress
  // thread and registrations), and only then the mappings it wrote through.
  std::unique_ptr<RemoteReceiver> receiver;
  std::vector<DmaBufCpuAccess> cpu_access;  // held while a grant is open (dma-buf chunks only)
  bool cpu_access_held = false;
};

class Service {
 public:
  explicit Service(const ReceiverServiceOptions& options) : options_(options) {}

  Result<void> send(const ReceiverReply& reply) {
    const std::string text = layout::encode_receiver_reply(reply);
    const auto frame = handshake::length_prefixed(text);
    return handshake::send_frame(options_.control_fd, frame, {}, kReplyTimeoutMs, "remote receiver reply");
  }

  ReceiverReply handle(const ReceiverRequest& request) {
    ReceiverReply reply;
    reply.op = request.op;
    Result<void> done = [&]() -> Result<void> {
      switch (request.op) {
        case ReceiverOp::listen:
          return listen(request, reply);
        case ReceiverOp::grant:
          return grant(request, reply);
        case ReceiverOp::complete:
          return complete(request, reply);
        case ReceiverOp::revoke:
          return revoke(request);
        case ReceiverOp::hello:
          break;
      }
      return fail(EINVAL, "unexpected request");
    }();
    if (!done) {
      reply.ok = false;
      reply.error_errno = done.error().errno_value();
      reply.error = done.error().what();
      say(fmt::format("{} failed: {}", layout::receiver_op_name(request.op), reply.error));
    }
    return reply;
  }

 private:
  // One pending listen a slot's handoff opened; its grant (or a revoke) takes it away.
  static constexpr size_t kMaxPendingListens = 64;

  Result<void> listen(const ReceiverRequest& request, ReceiverReply& reply) {
    pending_.erase(request.socket_name);  // a listen of the same name that never came to a grant
    if (pending_.size() >= kMaxPendingListens)
      return fail(EBUSY, "listen {}: {} listens are pending already (each ends at its grant or revoke)",
                  request.socket_name, pending_.size());
    auto broker = ShareBroker::listen_in(options_.private_dir, request.socket_name);
    if (!broker) return fail(broker.error());
    auto [it, added] = pending_.emplace(request.socket_name, std::move(*broker));
    reply.socket_path = it->second.socket_path();
    return {};
  }

  Result<void> grant(const ReceiverRequest& request, ReceiverReply& reply) {
    auto listening = pending_.find(request.socket_name);
    if (listening == pending_.end())
      return fail(EINVAL, "grant of {} cells from socket {}: no listen of that name is pending", request.n_cells,
                  request.socket_name);
    const auto start = std::chrono::steady_clock::now();
    auto share = listening->second.receive(kShareMessageTimeoutMs);
    pending_.erase(listening);
    if (!share) return fail(share.error().with_context("taking the decoder's share"));
    // The decoder's message names the slot's cells: position p in cell first_cell + p of
    // `stream`, p < n_cells (0: the whole stream). The prompt must fit them.
    if (share->n_cells != 0 && request.n_cells > share->n_cells)
      return fail(ERANGE,
                  "grant of {} cells (\"n_cells\"), the decoder's share names {} cells (from cell {} of stream {}): "
                  "the prompt does not fit the slot's cells",
                  request.n_cells, share->n_cells, share->first_cell, share->stream);
    auto key = region_key(*share);
    if (!key) return fail(key.error());
    if (!region_ || region_->key != *key) {
      // A new region: the old one (if any, and every grant of it) is dropped before the new
      // one is mapped, so two caches' worth of registrations never coexist.
      region_.reset();
      std::vector<uint64_t> offsets;
      for (const auto& entry : share->entries) offsets.push_back(entry.offset);
      auto imported = ImportedShare::import(share->header.layout, std::move(share->fds), offsets, true);
      if (!imported) return fail(imported.error().with_context("mapping the decoder's region"));
      auto region = std::make_unique<Region>();
      region->key = std::move(*key);
      region->header = share->header;
      region->imported = std::move(*imported);
      const auto chunks = region->imported.chunk_bytes();
      auto receiver =
          RemoteReceiver::start(region->header, std::vector<std::span<std::byte>>(chunks.begin(), chunks.end()),
                                [](const std::string& line) { say(line); });
      if (!receiver) return fail(receiver.error());
      region->receiver = std::move(*receiver);
      region_ = std::move(region);
      reply.region_mapped = true;
      say(fmt::format("the decoder's region: {} chunk(s), {} bytes, mapped and registered with UCX once ({:.3f} ms)",
                      chunks.size(), total_bytes(chunks), ms_since(start)));
    }
    // CPU access is begun with the first open grant and held while any grant is open.
    if (!region_->cpu_access_held) {
      auto access = region_->imported.begin_cpu_access(DmaBufCpuAccess::Mode::write);
      if (!access) return fail(access.error());
      region_->cpu_access = std::move(*access);
      region_->cpu_access_held = true;
    }
    const PromptCells cells{share->stream, share->first_cell, request.n_cached, request.n_cells};
    auto offer = region_->receiver->grant(cells, std::chrono::milliseconds(request.timeout_ms));
    if (!offer) {
      end_cpu_access_when_idle();
      return fail(offer.error());
    }
    reply.share_id = share->share_id;
    reply.offer = nlohmann::json::parse(to_json(*offer).dump());
    reply.region_ms = ms_since(start);
    return {};
  }

  Result<void> complete(const ReceiverRequest& request, ReceiverReply& reply) {
    if (!region_)
      return fail(ESTALE, "remote share {}: no region is mapped (no grant since this receiver started)",
                  request.grant_id);
    auto completed = region_->receiver->complete(request.grant_id, request.n_tokens);
    end_cpu_access_when_idle();
    if (!completed) return fail(completed.error());
    reply.bytes_received = *completed;
    return {};
  }

  // The named listen and/or grant; neither named: every listen and every grant.
  Result<void> revoke(const ReceiverRequest& request) {
    const bool names_one = !request.socket_name.empty() || request.grant_id != 0;
    if (!request.socket_name.empty()) pending_.erase(request.socket_name);
    if (!names_one) pending_.clear();
    if (region_) {
      if (request.grant_id != 0)
        region_->receiver->revoke(request.grant_id, request.why);
      else if (!names_one)
        region_->receiver->revoke_all(request.why);
      end_cpu_access_when_idle();
    }
    return {};
  }

  void end_cpu_access_when_idle() {
    if (region_ && region_->cpu_access_held && region_->receiver->open_grants() == 0) {
      region_->cpu_access.clear();
      region_->cpu_access_held = false;
    }
  }

  static uint64_t total_bytes(std::span<const std::span<std::byte>> chunks) {
    uint64_t total = 0;
    for (const auto& chunk : chunks) total += chunk.size();
    return total;
  }

  const ReceiverServiceOptions& options_;
  std::map<std::string, ShareBroker> pending_;  // by socket name
  std::unique_ptr<Region> region_;
};

// Blocks until serve sends something or closes the channel. False on a clean close.
Result<bool> wait_for_request(int fd) {
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    const int n = ::poll(&p, 1, -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail(errno, "poll on the control socket fd {}", fd);
    char byte;
    const ssize_t peeked = ::recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (peeked > 0) return true;
    if (peeked == 0) return false;
    if (errno == EAGAIN || errno == EINTR) continue;
    if (errno == ECONNRESET) return false;
    return fail(errno, "recv on the control socket fd {}", fd);
  }
}

}  // namespace

int run_receiver_service(const ReceiverServiceOptions& options) {
  Service service(options);
  ReceiverReply hello;
  hello.op = ReceiverOp::hello;
  hello.pid = static_cast<uint64_t>(::getpid());
  if (auto sent = service.send(hello); !sent) {
    say(sent.error().what());
    return 1;
  }
  for (;;) {
    auto more = wait_for_request(options.control_fd);
    if (!more) {
      say(more.error().what());
      return 1;
    }
    if (!*more) return 0;  // serve closed the channel: it is stopping
    auto frame = handshake::receive_frame(options.control_fd, kFrameTimeoutMs, kPeer, -1, "remote receiver request",
                                          layout::kMaxReceiverMessageBytes);
    if (!frame) {
      say(frame.error().what());
      return 1;
    }
    if (!frame->fds.empty()) {
      say(fmt::format("a request from {} carried {} fd(s); this channel carries none (closed)", kPeer,
                      frame->fds.size()));
      return 1;
    }
    auto request = layout::parse_receiver_request(
        std::string_view(reinterpret_cast<const char*>(frame->body.data()), frame->body.size()), kPeer);
    if (!request) {
      say(request.error().what());
      return 1;
    }
    if (auto sent = service.send(service.handle(*request)); !sent) {
      say(sent.error().what());
      return 1;
    }
  }
}

}  // namespace kvshare::remote
