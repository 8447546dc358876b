// kvshare-remote-receiver: the decode host's end of the remote route, in a process a remote
// peer may crash without taking the decoder or serve along. kvshare-serve --prefill-remote
// starts and supervises it; it is not meant to be run by hand. docs/remote.md.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>

#include "kvshare/remote/receiver_service.h"

int main(int argc, char** argv) {
  kvshare::remote::ReceiverServiceOptions o;
  std::string private_dir;
  CLI::App app{
      "kvshare-remote-receiver: lands a remote provider's KV writes (UCX) in the decoder's cache, every "
      "write bounds-checked first. Started by kvshare-serve --prefill-remote with one end of a socket pair; "
      "the decoder's region reaches it through the share handshake (docs/remote.md)."};
  app.add_option("--control-fd", o.control_fd, "the socket pair end kvshare-serve passed (requests and replies)")
      ->required()
      ->check(CLI::Range(3, 1 << 20));
  app.add_option("--private-dir", private_dir, "kvshare-serve's 0700 slot directory, where share sockets are made")
      ->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  o.private_dir = private_dir;
  return kvshare::remote::run_receiver_service(o);
}
