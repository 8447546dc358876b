#include <cerrno>
#include <cstdio>
#include <optional>

#include "kvshare/route/share_session.h"
#include "kvshare/share/broker.h"

namespace kvshare::route {
namespace {

// One request's handshake on the zerocopy core's broker (kvshare/share/broker.h): its
// private 0700 directory and socket, the checked SCM_RIGHTS receive, the header file, and
// the provider spawn (fds at 3, 4, ...; nothing else inherited; the group killed at the
// timeout). Destroying it closes the fds and removes the socket and the directory.
class BrokerSession final : public ShareSession {
 public:
  explicit BrokerSession(::kvshare::ShareBroker broker) : broker_(std::move(broker)) {}

  const std::string& socket_path() const override { return broker_.socket_path(); }

  Result<uint64_t> receive(std::chrono::milliseconds timeout) override {
    auto share = broker_.receive(static_cast<int>(timeout.count()));
    if (!share) return fail(share.error());
    share_ = std::move(*share);
    return share_->share_id;
  }

  ProviderRun run_provider(std::vector<std::string> argv, std::chrono::milliseconds timeout) override {
    ProviderRun run;
    if (!share_) {
      run.start_error = Error(EINVAL, "no fds received before the provider");
      return run;
    }
    argv.insert(argv.end(), {"--layout", "{layout}", "--fds", "{fds}"});
    auto child = broker_.run_provider(*share_, argv, static_cast<int>(timeout.count()));
    if (!child) {
      run.start_error = child.error();
      return run;
    }
    run.started = true;
    run.timed_out = child->timed_out;
    run.wall_ms = child->elapsed_ms;
    // ChildResult folds a signal into 128 + signal.
    if (child->exit_code > 128 && child->exit_code < 128 + 65) {
      run.status.signal = child->exit_code - 128;
    } else {
      run.status.exited = true;
      run.status.code = child->exit_code;
    }
    run.out = child->stdout_text;
    run.reported_prefill_ms = reported_prefill_ms(child->stdout_text);
    // The provider's own words belong on serve's stderr, as on the file route.
    if (!child->stderr_text.empty()) std::fputs(child->stderr_text.c_str(), stderr);
    return run;
  }

 private:
  ::kvshare::ShareBroker broker_;
  std::optional<ReceivedShare> share_;
};

class KvshareBroker final : public ShareBroker {
 public:
  Result<std::unique_ptr<ShareSession>> open() override {
    auto broker = ::kvshare::ShareBroker::listen();
    if (!broker) return fail(broker.error());
    return std::unique_ptr<ShareSession>(new BrokerSession(std::move(*broker)));
  }
};

}  // namespace

std::unique_ptr<ShareBroker> make_kvshare_broker() { return std::make_unique<KvshareBroker>(); }

}  // namespace kvshare::route
