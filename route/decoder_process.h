// The decoder child: serve starts it on a free loopback port with a private slot
// directory, waits until /health says ok, watches it, and stops it on exit. It is never
// restarted silently: if it dies, serve says so and exits.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kvshare/share/spawn.h"
#include "layout/error.h"
#include "route/serve_config.h"

namespace kvshare::route {

// A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it, close).
// Another process may take it before the decoder binds it: start() checks who listens.
Result<int> pick_free_loopback_port();

// The inode of the IPv4 TCP socket listening on `port` of 127.0.0.1 or 0.0.0.0
// (/proc/net/tcp), 0 when nothing listens there.
Result<uint64_t> loopback_listener_inode(int port);
// Whether a process of process group `pgid` holds socket `inode` (/proc/<pid>/fd).
bool process_group_holds_socket(pid_t pgid, uint64_t inode);

// A fresh private directory (mode 0700, mkdtemp) under $TMPDIR or /tmp, named after `stem`.
Result<std::filesystem::path> make_private_dir(const std::string& stem);

class DecoderProcess {
 public:
  // Creates the slot directory, picks a port, starts the backend and waits (at most
  // `ready_timeout`) for GET /health to answer 200 from a socket the decoder's own process
  // group listens on: a third process that took the port between the pick and the
  // decoder's bind is never mistaken for it (the decoder is restarted on a fresh port, up
  // to three times). Fails naming the command when the child exits first or never gets
  // ready (the child is stopped, the directory removed).
  // `on_death` runs once, on the watcher thread, if the child exits while serve has not
  // asked it to: serve's cue to stop.
  static Result<std::unique_ptr<DecoderProcess>> start(const ServeConfig& config, const Backend& backend,
                                                       std::chrono::milliseconds ready_timeout,
                                                       std::function<void(const ExitStatus&)> on_death);
  ~DecoderProcess();  // stop()
  DecoderProcess(const DecoderProcess&) = delete;
  DecoderProcess& operator=(const DecoderProcess&) = delete;

  int port() const { return port_; }
  const std::filesystem::path& slot_dir() const { return slot_dir_; }
  const std::vector<std::string>& command() const { return command_; }

  // SIGTERM, a few seconds' grace, SIGKILL; removes the slot directory. Idempotent.
  void stop();

 private:
  DecoderProcess() = default;
  // One attempt on port_: ready (the decoder answers /health from its own socket), or the
  // port turned out to be someone else's. An error when the decoder failed otherwise.
  enum class Readiness { ready, port_taken };
  Result<Readiness> start_on_port(std::chrono::steady_clock::time_point deadline,
                                  std::chrono::milliseconds ready_timeout);
  void watch();

  std::vector<std::string> command_;
  std::vector<std::string> env_;  // "NAME=VALUE" set for the decoder on top of serve's environment
  std::filesystem::path slot_dir_;
  int port_ = 0;
  pid_t pid_ = -1;
  std::function<void(const ExitStatus&)> on_death_;

  std::mutex mutex_;
  std::condition_variable changed_;
  ChildProcess child_;  // guarded by mutex_ once the watcher runs
  bool stopping_ = false;
  bool exited_ = false;
  ExitStatus exit_status_;
  std::thread watcher_;
};

}  // namespace kvshare::route
