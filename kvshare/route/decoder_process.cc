#include "kvshare/route/decoder_process.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

#include "kvshare/fd.h"
#include "kvshare/route/decoder_client.h"

namespace kvshare::route {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kWatchInterval = std::chrono::milliseconds(20);
constexpr auto kStopGrace = std::chrono::seconds(5);

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

Result<std::unique_ptr<DecoderProcess>> DecoderProcess::start(const ServeConfig& config, const Backend& backend,
                                                              std::chrono::milliseconds ready_timeout,
                                                              std::function<void(const ExitStatus&)> on_death) {
  std::unique_ptr<DecoderProcess> decoder(new DecoderProcess());
  auto dir = make_private_dir("kvshare-serve-slots");
  if (!dir) return fail(dir.error().with_context("decoder slot directory"));
  decoder->slot_dir_ = *dir;
  auto port = pick_free_loopback_port();
  if (!port) return fail(port.error());
  decoder->port_ = *port;
  decoder->command_ = backend_command(config, backend, decoder->slot_dir_.string(), decoder->port_);
  decoder->on_death_ = std::move(on_death);

  SpawnOptions options;
  options.die_with_parent = true;
  options.stdout_to_stderr = true;  // serve's stdout is for serve; the decoder's log goes to stderr
  auto child = ChildProcess::spawn(decoder->command_, options);
  if (!child) return fail(child.error().with_context("starting the decoder " + join_command(decoder->command_)));
  decoder->pid_ = child->pid();
  decoder->child_ = std::move(*child);

  const DecoderClient client("127.0.0.1", decoder->port_, std::chrono::milliseconds(1000));
  const auto deadline = Clock::now() + ready_timeout;
  while (true) {
    if (auto status = decoder->child_.poll_exit())
      return fail(ECHILD, "the decoder exited before it was ready ({}): {}", status->describe(),
                  join_command(decoder->command_));
    auto health = client.get("/health");
    if (health && health->status == 200) break;
    if (Clock::now() > deadline)
      return fail(ETIMEDOUT, "the decoder did not answer GET /health with 200 within {} ms: {}",
                  ready_timeout.count(), join_command(decoder->command_));
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  decoder->watcher_ = std::thread([raw = decoder.get()] { raw->watch(); });
  return decoder;
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
