// kvshare-fake-resident-provider: a resident provider for serve's supervision tests
// (tests/route/resident_provider_test.cc). It speaks the protocol through the real
// provider channel and proves what it received by what it writes: a shared prefill writes its
// ids as int32 into the first bytes of the region's chunk 0, through the mapping it made at
// the region request; a file prefill writes a one-line text file naming what it was asked.
// --fault makes it misbehave on its first prefill: exit, hang, garbage, stale, fd.
//
//   kvshare-fake-resident-provider (--serve-fd N | --serve PATH) [--fault F] [--file-only]
#include <fmt/format.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <thread>

#include "kvshare/handshake/message.h"
#include "kvshare/handshake/transport.h"
#include "kvshare/region/importer.h"
#include "kvshare/share/provider_channel.h"

namespace {

using namespace kvshare;

struct Held {
  uint64_t region_id = 0;
  ImportedShare imported;
};

void say(const std::string& line) { std::fprintf(stderr, "fake-resident-provider: %s\n", line.c_str()); }

ProviderReply refusal(ProviderOp op, int errnum, std::string message) {
  ProviderReply reply;
  reply.op = op;
  reply.ok = false;
  reply.error_errno = errnum;
  reply.error = std::move(message);
  return reply;
}

// Serves one channel; returns false when the process should end with 1.
bool serve(ProviderChannel& channel, const std::string& fault, bool file_only) {
  ProviderReply hello;
  hello.op = ProviderOp::hello;
  hello.pid = static_cast<uint64_t>(::getpid());
  hello.takes_shared = !file_only;
  hello.takes_cached = true;
  if (fault == "garbage-hello") {
    const auto frame = handshake::length_prefixed("{\"not\":\"hello\"}");
    (void)handshake::send_frame(channel.fd(), frame, {}, 10000, "garbage");
  } else if (!channel.say_hello(hello)) {
    return false;
  }
  std::optional<Held> held;
  int prefills = 0;
  for (;;) {
    auto call = channel.next();
    if (!call) {
      if (call.error().errno_value() == ENODATA) return true;
      say(call.error().what());
      return false;
    }
    const ProviderRequest& request = call->request;
    if (request.op == ProviderOp::region) {
      if (fault == "refuse-region") {
        (void)channel.reply(refusal(ProviderOp::region, EINVAL, "region refused on demand"));
        continue;
      }
      held.reset();
      std::vector<uint64_t> offsets;
      for (const auto& entry : call->region->entries) offsets.push_back(entry.offset);
      auto imported = ImportedShare::import(call->region->header.layout, std::move(call->region->fds), offsets, true);
      if (!imported) {
        (void)channel.reply(refusal(ProviderOp::region, imported.error().errno_value(), imported.error().what()));
        continue;
      }
      held = Held{request.region_id, std::move(*imported)};
      say(fmt::format("region {} (share {})", request.region_id, call->region->share_id));
      ProviderReply reply;
      reply.op = ProviderOp::region;
      reply.region_id = request.region_id;
      reply.region_ms = 0.25;
      if (!channel.reply(reply)) return false;
      continue;
    }
    const bool first = ++prefills == 1;
    if (first && fault == "exit-on-prefill") std::_Exit(3);
    if (first && fault == "hang-on-prefill") {
      for (;;) ::pause();
    }
    if (first && fault == "garbage-reply") {
      const auto frame = handshake::length_prefixed("not json");
      (void)handshake::send_frame(channel.fd(), frame, {}, 10000, "garbage");
      continue;
    }
    if (first && fault == "send-fd") {
      const auto frame = handshake::length_prefixed(encode_provider_reply(refusal(ProviderOp::prefill, EIO, "fd")));
      const int fds[] = {2};
      (void)handshake::send_frame(channel.fd(), frame, fds, 10000, "an fd");
      continue;
    }
    if (first && fault == "stale-once") {
      held.reset();  // as if it had dropped the region
    }
    if (first && fault == "fail-prefill") {
      (void)channel.reply(refusal(ProviderOp::prefill, EIO, "prefill failed on demand"));
      continue;
    }
    ProviderReply reply;
    reply.op = ProviderOp::prefill;
    if (request.route == PrefillRoute::shared) {
      if (!held || held->region_id != request.region_id) {
        (void)channel.reply(
            refusal(ProviderOp::prefill, ESTALE,
                    held ? fmt::format("region {} is not the one held ({})", request.region_id, held->region_id)
                         : std::string("no region is held")));
        continue;
      }
      auto chunk = held->imported.chunk_bytes()[0];
      const size_t bytes = std::min(chunk.size(), request.tokens.size() * sizeof(int32_t));
      std::memcpy(chunk.data(), request.tokens.data(), bytes);
    } else {
      std::ofstream out(request.state_file, std::ios::trunc);
      out << fmt::format("tokens {} n_ctx {} type_k {} type_v {} flash_attn {} version {}\n", request.tokens.size(),
                         request.kv.n_ctx, request.kv.type_k, request.kv.type_v, request.kv.flash_attn,
                         request.state_version);
    }
    reply.prefill_ms = 0.5;
    reply.n_prefilled = static_cast<uint32_t>(request.tokens.size() - request.n_cached);
    if (!channel.reply(reply)) return false;
  }
}

}  // namespace

int main(int argc, char** argv) {
  int serve_fd = -1;
  std::string path, fault = "none";
  bool file_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--serve-fd" && i + 1 < argc)
      serve_fd = std::atoi(argv[++i]);
    else if (arg == "--serve" && i + 1 < argc)
      path = argv[++i];
    else if (arg == "--fault" && i + 1 < argc)
      fault = argv[++i];
    else if (arg == "--file-only")
      file_only = true;
    else if (arg == "--model" && i + 1 < argc)
      ++i;  // what serve passes; nothing to load
    else {
      say("usage: --serve-fd N | --serve PATH [--fault F] [--file-only]");
      return 2;
    }
  }
  if (serve_fd >= 0) {
    auto channel = ProviderChannel::from_fd(Fd(serve_fd));
    if (!channel) {
      say(channel.error().what());
      return 1;
    }
    return serve(*channel, fault, file_only) ? 0 : 1;
  }
  auto listener = ProviderListener::listen(path);
  if (!listener) {
    say(listener.error().what());
    return 1;
  }
  std::printf("listening\n");
  std::fflush(stdout);
  for (;;) {
    auto channel = listener->accept();
    if (!channel) {
      say(channel.error().what());
      return 1;
    }
    // A serve that went away mid-channel (or a probe that only connected) is not the end:
    // the next one is accepted, as a real listening provider does.
    (void)serve(*channel, fault, file_only);
  }
}
