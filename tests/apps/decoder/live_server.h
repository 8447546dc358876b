// A decoder process for client tests: kvshare-decoder (or, with LLAMA_SERVER=path, a real
// llama-server) started on a free 127.0.0.1 port with the same flags, waited for through
// /health and stopped with SIGTERM. The same client tests run against either.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "route/decoder_client.h"

extern char** environ;

namespace kvshare::decoder::testing {

// A port nobody listens on right now (bound then released: good enough on loopback).
inline int free_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    socklen_t len = sizeof addr;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

class LiveServer {
 public:
  // Starts `binary` with `args` plus --host 127.0.0.1 --port P; `env` entries are added
  // to (or override) this process's environment. Waits up to 60 s for /health.
  LiveServer(const std::filesystem::path& binary, std::vector<std::string> args, const std::filesystem::path& log,
             const std::vector<std::string>& env = {}, const std::vector<std::string>& unset_env = {})
      : log_(log) {
    port_ = free_loopback_port();
    args.insert(args.begin(), binary.string());
    args.push_back("--host");
    args.push_back("127.0.0.1");
    args.push_back("--port");
    args.push_back(std::to_string(port_));
    std::vector<std::string> environment;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry = *e;
      const std::string name = entry.substr(0, entry.find('='));
      bool drop = false;
      for (const auto& u : unset_env) drop = drop || name == u;
      for (const auto& kv : env) drop = drop || name == kv.substr(0, kv.find('='));
      if (!drop) environment.push_back(entry);
    }
    environment.insert(environment.end(), env.begin(), env.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<char*> envp;
    for (auto& e : environment) envp.push_back(e.data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    const int rc = posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) {
      ADD_FAILURE() << "cannot start " << binary << ": " << std::strerror(rc);
      pid_ = -1;
      return;
    }
    client_ = std::make_unique<route::DecoderClient>("127.0.0.1", port_, std::chrono::seconds(120));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < deadline) {
      auto health = client_->get("/health");
      if (health && health->status == 200) {
        ready_ = true;
        return;
      }
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        ADD_FAILURE() << binary << " exited before it was ready; log:\n" << log_text();
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ADD_FAILURE() << binary << " not ready after 60 s; log:\n" << log_text();
  }

  ~LiveServer() {
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);
      int status = 0;
      for (int i = 0; i < 200 && ::waitpid(pid_, &status, WNOHANG) == 0; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(25));
      }
      if (::waitpid(pid_, &status, WNOHANG) == 0) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status, 0);
      }
    }
  }

  // Sends SIGTERM and returns the exit status (for the shutdown test).
  int terminate() {
    if (pid_ <= 0) return -1;
    ::kill(pid_, SIGTERM);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }

  bool ready() const { return ready_; }
  std::string base_url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int port() const { return port_; }
  const route::DecoderClient& client() const { return *client_; }
  std::string log_text() const {
    std::ifstream in(log_);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

 private:
  std::filesystem::path log_;
  pid_t pid_ = -1;
  int port_ = -1;
  bool ready_ = false;
  std::unique_ptr<route::DecoderClient> client_;
};

}  // namespace kvshare::decoder::testing
