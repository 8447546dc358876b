#include "route/decoder_process.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "kvshare/fd.h"
#include "route/decoder_client.h"

namespace kvshare::route {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kWatchInterval = std::chrono::milliseconds(20);
constexpr auto kStopGrace = std::chrono::seconds(5);
constexpr int kPortAttempts = 3;

}  // namespace

Result<int> pick_free_loopback_port() {
  Fd socket_fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!socket_fd) return fail(errno, "free port: socket");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  if (::bind(socket_fd.get(), reinterpret_cast<sockaddr*>(&address), sizeof address) != 0)
    return fail(errno, "free port: bind 127.0.0.1:0");
  socklen_t length = sizeof address;
  if (::getsockname(socket_fd.get(), reinterpret_cast<sockaddr*>(&address), &length) != 0)
    return fail(errno, "free port: getsockname");
  return static_cast<int>(ntohs(address.sin_port));
}

Result<std::filesystem::path> make_private_dir(const std::string& stem) {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/" + stem + "-XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) return fail(errno, "mkdtemp {}", pattern);
  return std::filesystem::path(pattern);  // mkdtemp makes it 0700
}

Result<uint64_t> loopback_listener_inode(int port) {
  std::ifstream table("/proc/net/tcp");
  if (!table) return fail(errno, "reading /proc/net/tcp to see who listens on port {}", port);
  std::string line;
  std::getline(table, line);  // the column names
  const auto port_hex = fmt::format(":{:04X}", port);
  while (std::getline(table, line)) {
    // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
    std::istringstream fields(line);
    std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
    if (!(fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >> inode))
      continue;
    if (state != "0A" || local.size() != 13 || local.substr(8) != port_hex) continue;  // 0A: TCP_LISTEN
    const std::string address = local.substr(0, 8);
    if (address != "0100007F" && address != "00000000") continue;  // 127.0.0.1 or 0.0.0.0, little-endian
    uint64_t value = 0;
    std::from_chars(inode.data(), inode.data() + inode.size(), value);
    return value;
  }
  return uint64_t{0};
}

bool process_group_holds_socket(pid_t pgid, uint64_t inode) {
  const std::string wanted = fmt::format("socket:[{}]", inode);
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string text;
    if (!std::getline(stat, text)) continue;
    // pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses, so read after the last ')'.
    const size_t close = text.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(text.substr(close + 1));
    std::string state;
    long ppid = 0, group = 0;
    if (!(rest >> state >> ppid >> group) || group != pgid) continue;
    std::error_code fd_ec;
    for (const auto& fd : std::filesystem::directory_iterator(entry.path() / "fd", fd_ec)) {
      std::error_code link_ec;
      if (std::filesystem::read_symlink(fd.path(), link_ec).string() == wanted) return true;
    }
  }
  return false;
}

Result<std::unique_ptr<DecoderProcess>> DecoderProcess::start(const ServeConfig& config, const Backend& backend,
                                                              std::chrono::milliseconds ready_timeout,
                                                              std::function<void(const ExitStatus&)> on_death) {
  std::unique_ptr<DecoderProcess> decoder(new DecoderProcess());
  auto dir = make_private_dir("kvshare-serve-slots");
  if (!dir) return fail(dir.error().with_context("decoder slot directory"));
  decoder->slot_dir_ = *dir;
  decoder->on_death_ = std::move(on_death);
  const auto deadline = Clock::now() + ready_timeout;
  for (int attempt = 1;; ++attempt) {
    auto port = pick_free_loopback_port();
    if (!port) return fail(port.error());
    decoder->port_ = *port;
    decoder->command_ = backend_command(config, backend, decoder->slot_dir_.string(), decoder->port_);
    // The remote route takes the decoder's region by the share handshake: it must export
    // (a stock llama-server ignores the variable; the state variant needs no export).
    if (!config.prefill_remote.empty() && config.prefill_remote_route != RemoteRouteKind::state)
      decoder->env_ = {"ONEBIT_KV_SHARE=1"};
    auto ready = decoder->start_on_port(deadline, ready_timeout);
    if (!ready) return fail(ready.error());
    if (*ready == Readiness::ready) break;
    decoder->child_.kill_group();
    if (attempt == kPortAttempts)
      return fail(EADDRINUSE, "another process took the decoder's port {} times in a row (the last was {}): {}",
                  kPortAttempts, decoder->port_, join_command(decoder->command_));
  }
  decoder->pid_ = decoder->child_.pid();
  decoder->watcher_ = std::thread([raw = decoder.get()] { raw->watch(); });
  return decoder;
}

Result<DecoderProcess::Readiness> DecoderProcess::start_on_port(std::chrono::steady_clock::time_point deadline,
                                                                std::chrono::milliseconds ready_timeout) {
  SpawnOptions options;
  options.die_with_parent = true;
  options.stdout_to_stderr = true;  // serve's stdout is for serve; the decoder's log goes to stderr
  options.env = env_;
  auto child = ChildProcess::spawn(command_, options);
  if (!child) return fail(child.error().with_context("starting the decoder " + join_command(command_)));
  child_ = std::move(*child);
  // Whoever listens on the port must be the decoder (or a process it started).
  auto port_owner = [&]() -> std::optional<Readiness> {
    auto inode = loopback_listener_inode(port_);
    // Where /proc/net/tcp cannot be read there is nothing to check against: /health decides.
    if (!inode) return Readiness::ready;
    if (*inode == 0) return std::nullopt;
    if (process_group_holds_socket(child_.pid(), *inode)) return Readiness::ready;
    return Readiness::port_taken;
  };
  const DecoderClient client("127.0.0.1", port_, std::chrono::milliseconds(1000));
  while (true) {
    if (auto status = child_.poll_exit()) {
      if (port_owner() == Readiness::port_taken) return Readiness::port_taken;
      return fail(ECHILD, "the decoder exited before it was ready ({}): {}", status->describe(),
                  join_command(command_));
    }
    auto health = client.get("/health");
    if (health && health->status == 200) {
      const auto owner = port_owner();
      if (owner == Readiness::ready) return Readiness::ready;
      if (owner == Readiness::port_taken) return Readiness::port_taken;
    }
    if (Clock::now() > deadline)
      return fail(ETIMEDOUT, "the decoder did not answer GET /health with 200 within {} ms: {}", ready_timeout.count(),
                  join_command(command_));
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
}

void DecoderProcess::watch() {
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    if (auto status = child_.poll_exit()) {
      exited_ = true;
      exit_status_ = *status;
      lock.unlock();
      if (on_death_) on_death_(exit_status_);
      return;
    }
    changed_.wait_for(lock, kWatchInterval);
  }
}

void DecoderProcess::stop() {
  {
    std::lock_guard lock(mutex_);
    if (stopping_ && !watcher_.joinable() && pid_ < 0) return;
    stopping_ = true;
  }
  changed_.notify_all();
  if (watcher_.joinable()) watcher_.join();
  child_.terminate(kStopGrace);
  pid_ = -1;
  if (!slot_dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(slot_dir_, ec);
    slot_dir_.clear();
  }
}

DecoderProcess::~DecoderProcess() { stop(); }

}  // namespace kvshare::route
