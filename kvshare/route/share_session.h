// The shared route's steps that touch sockets and fds, behind a small interface: the
// router drives the order (listen -> share -> fds -> provider -> adopt) and the fallbacks;
// the zerocopy broker (kvshare/share) does the listening, the SCM_RIGHTS receive, the
// header file and the provider's inherited descriptors. Tests substitute their own.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "kvshare/route/provider_run.h"
#include "layout/error.h"

namespace kvshare::route {

// One request's handshake. Destroying it closes every received fd, unlinks the socket and
// removes its private directory and header file, whatever happened.
class ShareSession {
 public:
  virtual ~ShareSession() = default;
  // Where the decoder must connect (the body of POST /slots/0?action=share).
  virtual const std::string& socket_path() const = 0;
  // Accepts the decoder's connection and receives its message and fds, at most `timeout`.
  // Returns the message's share_id. Any error here is before the provider ran.
  virtual Result<uint64_t> receive(std::chrono::milliseconds timeout) = 0;
  // Runs the provider: `argv` plus --layout HEADER --fds n,... with the received fds
  // inherited at those numbers; waits at most `timeout` (then kills its group).
  virtual ProviderRun run_provider(std::vector<std::string> argv, std::chrono::milliseconds timeout) = 0;
};

class ShareBroker {
 public:
  virtual ~ShareBroker() = default;
  // Listens in a fresh private (0700) directory. An error means the handshake cannot start.
  virtual Result<std::unique_ptr<ShareSession>> open() = 0;
};

// The broker kvshare/share provides (the zerocopy core).
std::unique_ptr<ShareBroker> make_kvshare_broker();

}  // namespace kvshare::route
