#include "route/resident_process.h"

#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "kvshare/handshake/message.h"
#include "kvshare/handshake/transport.h"

namespace kvshare::route {
namespace {

using Clock = std::chrono::steady_clock;
// After the channel broke, how long the process may take to finish exiting before it is
// killed: the status it exits with (an abort, a signal) is the reason serve gives.
constexpr std::chrono::milliseconds kExitGrace{2000};

std::string_view body_of(const handshake::ReceivedFrame& frame) {
  return {reinterpret_cast<const char*>(frame.body.data()), frame.body.size()};
}

int clamp_ms(std::chrono::milliseconds timeout) {
  return static_cast<int>(std::clamp<long long>(timeout.count(), 1, INT32_MAX));
}

// A pidfd is readable once its process has ended.
bool wait_pidfd(int pidfd, std::chrono::milliseconds timeout) {
  pollfd entry{pidfd, POLLIN, 0};
  int n;
  do n = ::poll(&entry, 1, clamp_ms(timeout));
  while (n < 0 && errno == EINTR);
  return n > 0;
}

}  // namespace

ResidentProcess::ResidentProcess(Options options) : options_(std::move(options)) {}

ResidentProcess::~ResidentProcess() {
  std::lock_guard lock(mutex_);
  channel_.reset();  // the process reads EOF and exits 0 (a listener goes back to accepting)
  if (child_.running()) child_.terminate(kExitGrace);
}

pid_t ResidentProcess::pid() const {
  std::lock_guard lock(mutex_);
  return pid_;
}

uint64_t ResidentProcess::incarnation() const {
  std::lock_guard lock(mutex_);
  return incarnation_;
}

unsigned long long ResidentProcess::restarts() const {
  std::lock_guard lock(mutex_);
  return restarts_;
}

void ResidentProcess::note_success() {
  std::lock_guard lock(mutex_);
  losses_in_a_row_ = 0;
}

std::chrono::milliseconds ResidentProcess::backoff_locked() const {
  if (losses_in_a_row_ <= 0) return std::chrono::milliseconds(0);
  auto wait = kFirstResidentBackoff;
  for (int i = 1; i < losses_in_a_row_ && wait < kMaxResidentBackoff; ++i) wait *= 2;
  return std::min(wait, kMaxResidentBackoff);
}

// A connected peer is not our child: it is killed through its pidfd (it may hold the
// decoder's region mapped, and only its end guarantees that no late write lands), and its
// end is awaited on the pidfd; its exit status is not ours to read.
void ResidentProcess::end_peer_locked(std::optional<ExitStatus>& status) {
  if (!peer_pidfd_) return;
  if (wait_pidfd(peer_pidfd_.get(), std::chrono::milliseconds(0))) {
    peer_pidfd_.reset();
    return;
  }
  if (::syscall(SYS_pidfd_send_signal, peer_pidfd_.get(), SIGKILL, nullptr, 0) == 0 &&
      wait_pidfd(peer_pidfd_.get(), kExitGrace)) {
    status = ExitStatus{false, 0, SIGKILL};
  }
  peer_pidfd_.reset();
}

std::string ResidentProcess::lose_locked(const std::string& what_happened, bool wait_for_exit) {
  const pid_t pid = pid_;
  channel_.reset();
  std::optional<ExitStatus> status;
  std::string how;
  if (options_.connect_path.empty()) {
    // It may be on its way out already (an abort closes the channel as the process dies):
    // its own exit status says more than our SIGKILL would.
    status = child_.poll_exit();
    if (!status && wait_for_exit) {
      auto finished = child_.wait_for(kExitGrace);
      if (finished) status = finished->status;
    }
    if (!status) {
      child_.kill_group();
      status = child_.poll_exit();
    }
    how = status ? status->describe() : std::string("an unknown status");
    child_ = ChildProcess();
  } else {
    end_peer_locked(status);
    how = status ? "killed with " + status->describe() : std::string("gone");
  }
  last_end_ = fmt::format("{} (pid {}) {}: {}", options_.name, pid, what_happened, how);
  pid_ = -1;
  ++losses_in_a_row_;
  last_loss_ = Clock::now();
  if (options_.log)
    options_.log(fmt::format("kvshare-serve: {}; the next request starts another (back-off {} ms)", last_end_,
                             backoff_locked().count()));
  return last_end_;
}

Error ResidentProcess::lose(uint64_t incarnation, const std::string& what_happened) {
  std::lock_guard lock(mutex_);
  if (incarnation != incarnation_ || pid_ < 0)
    return Error(ESRCH, last_end_.empty() ? fmt::format("{} is not running", options_.name) : last_end_);
  return Error(ESRCH, lose_locked(what_happened, false));
}

Result<void> ResidentProcess::start_locked() {
  Fd ours;
  if (options_.connect_path.empty()) {
    int pair[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0)
      return fail(errno, "socketpair for {}'s channel", options_.name);
    ours.reset(pair[0]);
    Fd theirs(pair[1]);
    SpawnOptions spawn_options;
    spawn_options.inherit_fds = {{theirs.get(), kFirstInheritedFd}};
    spawn_options.die_with_parent = true;
    spawn_options.stdout_to_stderr = true;  // its lines join serve's stderr
    auto child = ChildProcess::spawn(options_.argv, spawn_options);
    if (!child) {
      ++losses_in_a_row_;
      last_loss_ = Clock::now();
      last_end_ = fmt::format("{} could not start: {}", options_.name, child.error().what());
      return fail(ESRCH, "{}", last_end_);
    }
    child_ = std::move(*child);
    pid_ = child_.pid();
  } else {
    auto connected = handshake::connect_checked_listener(options_.connect_path, clamp_ms(options_.hello_timeout));
    auto peer = connected ? handshake::peer_credentials(connected->get())
                          : Result<handshake::PeerCredentials>(fail(connected.error()));
    if (!peer) {
      ++losses_in_a_row_;
      last_loss_ = Clock::now();
      last_end_ =
          fmt::format("{} at {} could not be reached: {}", options_.name, options_.connect_path, peer.error().what());
      return fail(ESRCH, "{}", last_end_);
    }
    ours = std::move(*connected);
    pid_ = peer->pid;
    peer_pidfd_.reset(static_cast<int>(::syscall(SYS_pidfd_open, peer->pid, 0)));
  }
  channel_ = std::move(ours);
  ++incarnation_;
  auto hello = handshake::receive_frame(channel_.get(), clamp_ms(options_.hello_timeout), options_.name, -1, "hello",
                                        options_.max_frame_bytes);
  Result<void> checked = !hello ? Result<void>(fail(hello.error()))
                         : !hello->fds.empty()
                             ? Result<void>(fail(EPROTO, "its hello carried {} fd(s)", hello->fds.size()))
                         : options_.check_hello ? options_.check_hello(body_of(*hello))
                                                : Result<void>();
  if (!checked) return fail(ESRCH, "{}", lose_locked(fmt::format("did not start ({})", checked.error().what())));
  if (ever_started_) {
    ++restarts_;
    if (options_.on_restart) options_.on_restart();
    if (options_.log)
      options_.log(fmt::format("kvshare-serve: {} started again (pid {}, restart {})", options_.name, pid_, restarts_));
  }
  ever_started_ = true;
  return {};
}

bool ResidentProcess::running_locked() {
  if (pid_ < 0 || !channel_) return false;
  if (options_.connect_path.empty()) return !child_.poll_exit();
  // A peer that hung up (or sent something unasked) between requests is gone for us.
  pollfd entry{channel_.get(), POLLIN | POLLRDHUP, 0};
  return ::poll(&entry, 1, 0) == 0;
}

Result<void> ResidentProcess::ensure_running() {
  std::lock_guard lock(mutex_);
  if (pid_ >= 0) {
    if (running_locked()) return {};
    lose_locked(options_.connect_path.empty() ? "exited between requests" : "hung up between requests");
  }
  if (last_loss_) {
    const auto ready_at = *last_loss_ + backoff_locked();
    const auto now = Clock::now();
    if (now < ready_at)
      return fail(EAGAIN, "{}; starting another in {} ms (back-off)", last_end_,
                  std::chrono::duration_cast<std::chrono::milliseconds>(ready_at - now).count());
  }
  return start_locked();
}

Result<std::string> ResidentProcess::call(std::string_view body, std::span<const int> fds,
                                          std::chrono::milliseconds timeout, std::string_view what) {
  std::lock_guard lock(mutex_);
  if (pid_ < 0 || !channel_)
    return fail(ESRCH, "{}", last_end_.empty() ? fmt::format("{} is not running", options_.name) : last_end_);
  const auto frame = handshake::length_prefixed(body);
  const int timeout_ms = clamp_ms(timeout);
  if (auto sent = handshake::send_frame(channel_.get(), frame, fds, timeout_ms, fmt::format("{} request", what)); !sent)
    return fail(ESRCH, "{}",
                lose_locked(fmt::format("lost its channel at a {} request ({})", what, sent.error().what())));
  auto received = handshake::receive_frame(channel_.get(), timeout_ms, options_.name, -1, fmt::format("{} reply", what),
                                           options_.max_frame_bytes);
  if (!received) {
    const bool timed_out = received.error().errno_value() == ETIMEDOUT;
    // A process that is still working on the request may be writing the decoder's cells:
    // it is killed at once, not given a grace.
    return fail(ESRCH, "{}",
                lose_locked(timed_out ? fmt::format("did not answer a {} request within {} ms and was "
                                                    "killed",
                                                    what, timeout_ms)
                                      : fmt::format("died during a {} request", what),
                            !timed_out));
  }
  if (!received->fds.empty())
    return fail(ESRCH, "{}",
                lose_locked(fmt::format("sent {} fd(s) on its channel and was killed", received->fds.size()), false));
  return std::string(body_of(*received));
}

}  // namespace kvshare::route
