#include "route/remote_receiver_process.h"

#include <fmt/format.h>

#include <cerrno>

namespace kvshare::route {
namespace {

constexpr std::string_view kName = "the remote receiver";
constexpr std::string_view kPeer = "kvshare-remote-receiver";

ResidentProcess::Options resident_options(const RemoteReceiverProcess::Options& options) {
  ResidentProcess::Options resident;
  resident.name = std::string(kName);
  resident.argv = {options.program.string(), "--control-fd", std::to_string(kFirstInheritedFd), "--private-dir",
                   options.private_dir.string()};
  resident.log = options.log;
  if (Metrics* metrics = options.metrics) resident.on_restart = [metrics] { metrics->count_receiver_restart(); };
  resident.check_hello = [](std::string_view body) -> Result<void> {
    auto reply = layout::parse_receiver_reply(body, kPeer);
    if (!reply) return fail(reply.error());
    if (reply->op != layout::ReceiverOp::hello || !reply->ok)
      return fail(EPROTO, "{}: its first message is \"{}\", not hello", kPeer, layout::receiver_op_name(reply->op));
    return {};
  };
  resident.hello_timeout = options.hello_timeout;
  resident.max_frame_bytes = layout::kMaxReceiverMessageBytes;
  return resident;
}

}  // namespace

RemoteReceiverProcess::RemoteReceiverProcess(Options options) : process_(resident_options(options)) {}
RemoteReceiverProcess::~RemoteReceiverProcess() = default;

pid_t RemoteReceiverProcess::pid() const { return process_.pid(); }
unsigned long long RemoteReceiverProcess::restarts() const { return process_.restarts(); }
void RemoteReceiverProcess::note_success() { process_.note_success(); }
Result<void> RemoteReceiverProcess::ensure_running() {
  // Not while a call waits for its reply: a start belongs between calls.
  std::lock_guard one_call(calls_);
  return process_.ensure_running();
}

Result<layout::ReceiverReply> RemoteReceiverProcess::call(const layout::ReceiverRequest& request,
                                                          std::chrono::milliseconds timeout) {
  std::lock_guard one_call(calls_);
  const uint64_t incarnation = process_.incarnation();
  const std::string op(layout::receiver_op_name(request.op));
  auto body = process_.call(layout::encode_receiver_request(request), {}, timeout, op);
  if (!body) return fail(body.error());
  auto reply = layout::parse_receiver_reply(*body, kPeer);
  if (!reply)
    return fail(
        process_.lose(incarnation, fmt::format("broke the protocol ({}) and was killed", reply.error().what())));
  if (reply->op != request.op)
    return fail(process_.lose(incarnation, fmt::format("answered a {} request with \"{}\" and was killed", op,
                                                       layout::receiver_op_name(reply->op))));
  return reply;
}

}  // namespace kvshare::route
