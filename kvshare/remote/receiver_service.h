// kvshare-remote-receiver's main, as a library function: the decode host's end of the remote
// route in a process of its own, so that nothing a remote peer does to UCX (UCX 1.13 aborts
// the process that hosts a worker when a peer dies during wire-up) can reach the decoder or
// serve. serve starts it with one end of a socket pair and supervises it
// (route/remote_receiver_process.h); it answers serve's requests
// (layout/receiver_message.h) one at a time, several slots' listens and grants open at once:
//
//   listen  -> a ShareBroker socket of that name in `private_dir` (up to 64 pending); serve
//              asks the decoder to share to it
//   grant   -> the decoder's fds arrive on the named socket with every check of the local
//              share route, naming the slot's stream and cells; a region not seen before
//              (another fd identity or layout) is mapped and registered with UCX once
//              (RemoteReceiver::start); the grant's offer (version 3) goes back to serve
//   complete-> RemoteReceiver::complete of that grant: the adopt check
//   revoke  -> the named listen dropped and/or the named grant revoked (neither: all)
//
// Lifetime: the receiver maps the decoder's cache and may write only the cells of an open
// grant. It exits when serve closes the channel (or dies: PR_SET_PDEATHSIG), and whatever
// it mapped goes with it, so killing it is always a safe way to end every write.
#pragma once

#include <filesystem>

namespace kvshare::remote {

struct ReceiverServiceOptions {
  int control_fd = -1;                // the socket pair end serve passed (borrowed)
  std::filesystem::path private_dir;  // serve's 0700 slot directory: where share sockets go
};

// Says hello, then serves requests until serve closes the channel: 0. 1 when the channel
// breaks (a malformed frame from serve, a failed send), said on stderr.
int run_receiver_service(const ReceiverServiceOptions& options);

}  // namespace kvshare::remote
