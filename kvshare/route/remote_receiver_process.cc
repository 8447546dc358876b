#include "kvshare/route/remote_receiver_process.h"

#include <fmt/format.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>

#include "kvshare/handshake/message.h"
#include "kvshare/handshake/transport.h"

namespace kvshare::route {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::string_view kPeer = "kvshare-remote-receiver";
// After the channel broke, how long the receiver may take to finish exiting before it is
// killed: the status it exits with (an abort, a signal) is the reason serve gives.
constexpr std::chrono::milliseconds kExitGrace{2000};

std::string_view body_of(const handshake::ReceivedFrame& frame) {
  return {reinterpret_cast<const char*>(frame.body.data()), frame.body.size()};
}

}  // namespace

RemoteReceiverProcess::RemoteReceiverProcess(Options options) : options_(std::move(options)) {}

RemoteReceiverProcess::~RemoteReceiverProcess() {
  std::lock_guard lock(mutex_);
  channel_.reset();  // the receiver reads EOF and exits 0
  if (child_.running()) child_.terminate(kExitGrace);
}

pid_t RemoteReceiverProcess::pid() const {
  std::lock_guard lock(mutex_);
  return pid_;
}

unsigned long long RemoteReceiverProcess::restarts() const {
  std::lock_guard lock(mutex_);
  return restarts_;
}

void RemoteReceiverProcess::note_success() {
  std::lock_guard lock(mutex_);
  deaths_in_a_row_ = 0;
}

std::chrono::milliseconds RemoteReceiverProcess::backoff_locked() const {
  if (deaths_in_a_row_ <= 0) return std::chrono::milliseconds(0);
  auto wait = kFirstReceiverBackoff;
  for (int i = 1; i < deaths_in_a_row_ && wait < kMaxReceiverBackoff; ++i) wait *= 2;
  return std::min(wait, kMaxReceiverBackoff);
}

std::string RemoteReceiverProcess::lose_locked(const std::string& what_happened) {
  const pid_t pid = pid_;
  channel_.reset();
  // It may be on its way out already (a UCX abort closes the channel as the process dies):
  // its own exit status says more than our SIGKILL would.
  std::optional<ExitStatus> status = child_.poll_exit();
  if (!status) {
    auto finished = child_.wait_for(kExitGrace);
    if (finished) status = finished->status;
  }
  if (!status) {
    child_.kill_group();
    status = child_.poll_exit();
  }
  const std::string how = status ? status->describe() : std::string("an unknown status");
  last_end_ = fmt::format("the remote receiver (pid {}) {}: {}", pid, what_happened, how);
  child_ = ChildProcess();
  pid_ = -1;
  ++deaths_in_a_row_;
  last_death_ = Clock::now();
  if (options_.log)
    options_.log(fmt::format("kvshare-serve: {}; the next request starts another (back-off {} ms)", last_end_,
                             backoff_locked().count()));
  return last_end_;
}

Result<void> RemoteReceiverProcess::start_locked() {
  int pair[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0)
    return fail(errno, "socketpair for the remote receiver's channel");
  Fd ours(pair[0]);
  Fd theirs(pair[1]);
  SpawnOptions spawn_options;
  spawn_options.inherit_fds = {{theirs.get(), kFirstInheritedFd}};
  spawn_options.die_with_parent = true;
  spawn_options.stdout_to_stderr = true;  // its lines join serve's stderr
  const std::vector<std::string> argv = {options_.program.string(), "--control-fd",
                                         std::to_string(kFirstInheritedFd), "--private-dir",
                                         options_.private_dir.string()};
  auto child = ChildProcess::spawn(argv, spawn_options);
  if (!child) {
    ++deaths_in_a_row_;
    last_death_ = Clock::now();
    last_end_ = fmt::format("the remote receiver could not start: {}", child.error().what());
    return fail(ESRCH, "{}", last_end_);
  }
  theirs.reset();
  child_ = std::move(*child);
  pid_ = child_.pid();
  channel_ = std::move(ours);
  auto hello = handshake::receive_frame(channel_.get(), static_cast<int>(options_.hello_timeout.count()), kPeer, -1,
                                        "remote receiver hello", layout::kMaxReceiverMessageBytes);
  Result<layout::ReceiverReply> reply = hello ? layout::parse_receiver_reply(body_of(*hello), kPeer)
                                              : Result<layout::ReceiverReply>(fail(hello.error()));
  if (reply && (reply->op != layout::ReceiverOp::hello || !reply->ok))
    reply = fail(EPROTO, "{}: its first message is \"{}\", not hello", kPeer, layout::receiver_op_name(reply->op));
  if (!reply) return fail(ESRCH, "{}", lose_locked(fmt::format("did not start ({})", reply.error().what())));
  if (ever_started_) {
    ++restarts_;
    if (options_.metrics) options_.metrics->count_receiver_restart();
    if (options_.log)
      options_.log(fmt::format("kvshare-serve: remote receiver started again (pid {}, restart {})", pid_, restarts_));
  }
  ever_started_ = true;
  return {};
}

Result<void> RemoteReceiverProcess::ensure_running() {
  std::lock_guard lock(mutex_);
  if (child_.running()) {
    if (!child_.poll_exit()) return {};
    lose_locked("exited between requests");
  }
  if (last_death_) {
    const auto ready_at = *last_death_ + backoff_locked();
    const auto now = Clock::now();
    if (now < ready_at)
      return fail(EAGAIN, "{}; starting another in {} ms (back-off)", last_end_,
                  std::chrono::duration_cast<std::chrono::milliseconds>(ready_at - now).count());
  }
  return start_locked();
}

Result<layout::ReceiverReply> RemoteReceiverProcess::call(const layout::ReceiverRequest& request,
                                                          std::chrono::milliseconds timeout) {
  std::lock_guard lock(mutex_);
  if (!child_.running() || !channel_)
    return fail(ESRCH, "{}", last_end_.empty() ? std::string("the remote receiver is not running") : last_end_);
  const std::string op(layout::receiver_op_name(request.op));
  const auto frame = handshake::length_prefixed(layout::encode_receiver_request(request));
  const int timeout_ms = static_cast<int>(std::max<long long>(timeout.count(), 1));
  if (auto sent = handshake::send_frame(channel_.get(), frame, {}, timeout_ms, "remote receiver request"); !sent)
    return fail(ESRCH, "{}", lose_locked(fmt::format("lost its channel at a {} request ({})", op,
                                                     sent.error().what())));
  auto received = handshake::receive_frame(channel_.get(), timeout_ms, kPeer, -1, "remote receiver reply",
                                           layout::kMaxReceiverMessageBytes);
  if (!received) {
    const bool timed_out = received.error().errno_value() == ETIMEDOUT;
    return fail(ESRCH, "{}", lose_locked(timed_out ? fmt::format("did not answer a {} request within {} ms and was "
                                                                 "killed", op, timeout_ms)
                                                   : fmt::format("died during a {} request", op)));
  }
  if (!received->fds.empty())
    return fail(ESRCH, "{}", lose_locked(fmt::format("sent {} fd(s) on its channel and was killed",
                                                     received->fds.size())));
  auto reply = layout::parse_receiver_reply(body_of(*received), kPeer);
  if (!reply) return fail(ESRCH, "{}", lose_locked(fmt::format("broke the protocol ({}) and was killed",
                                                              reply.error().what())));
  if (reply->op != request.op)
    return fail(ESRCH, "{}", lose_locked(fmt::format("answered a {} request with \"{}\" and was killed", op,
                                                     layout::receiver_op_name(reply->op))));
  return reply;
}

}  // namespace kvshare::route
