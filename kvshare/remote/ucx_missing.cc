// The remote route without UCX: every entry point says so (ENOTSUP); nothing else runs.
#include <cerrno>

#include "kvshare/remote/remote_receiver.h"
#include "kvshare/remote/remote_sender.h"

namespace kvshare::remote {
namespace {
constexpr const char* kNoUcx = "kvshare was built without UCX (libucx-dev, pkg-config ucx): no remote route";
}

struct RemoteReceiver::Impl {};
RemoteReceiver::RemoteReceiver(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RemoteReceiver::~RemoteReceiver() = default;
Result<std::unique_ptr<RemoteReceiver>> RemoteReceiver::start(const layout::ShareHeader&,
                                                              std::vector<std::span<std::byte>>, ReceiverLog) {
  return fail(ENOTSUP, "{}", kNoUcx);
}
Result<RemoteOffer> RemoteReceiver::grant(const PromptCells&, std::chrono::milliseconds) {
  return fail(ENOTSUP, "{}", kNoUcx);
}
Result<uint64_t> RemoteReceiver::complete(uint64_t, uint32_t) { return fail(ENOTSUP, "{}", kNoUcx); }
void RemoteReceiver::revoke(uint64_t, std::string_view) {}
void RemoteReceiver::revoke_all(std::string_view) {}
bool RemoteReceiver::issued(uint64_t) const { return false; }
size_t RemoteReceiver::open_grants() const { return 0; }
ReceiverCounters RemoteReceiver::counters() const { return {}; }

struct RemoteSender::Impl {};
RemoteSender::RemoteSender(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RemoteSender::~RemoteSender() = default;
Result<std::unique_ptr<RemoteSender>> RemoteSender::connect(std::span<const std::byte>) {
  return fail(ENOTSUP, "{}", kNoUcx);
}
Result<void> RemoteSender::write(const layout::RemoteWrite&, std::span<const std::byte>) {
  return fail(ENOTSUP, "{}", kNoUcx);
}
Result<void> RemoteSender::send_raw(unsigned, std::span<const std::byte>, std::span<const std::byte>) {
  return fail(ENOTSUP, "{}", kNoUcx);
}
Result<void> RemoteSender::flush(std::chrono::steady_clock::time_point) { return fail(ENOTSUP, "{}", kNoUcx); }
Result<void> RemoteSender::finish(const layout::RemoteDone&, std::chrono::steady_clock::time_point) {
  return fail(ENOTSUP, "{}", kNoUcx);
}
uint64_t RemoteSender::bytes_sent() const { return 0; }

}  // namespace kvshare::remote
