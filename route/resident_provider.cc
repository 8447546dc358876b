#include "route/resident_provider.h"

#include <fmt/format.h>

#include <cerrno>

#include "kvshare/share/spawn.h"
#include "layout/share_header.h"

namespace kvshare::route {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::string_view kName = "the resident provider";

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

}  // namespace

std::vector<std::string> resident_provider_command(const std::string& program, const std::string& model,
                                                   const std::string& elfs_dir) {
  std::vector<std::string> argv = {program, "--model", model};
  if (!elfs_dir.empty()) argv.insert(argv.end(), {"--elfs", elfs_dir});
  argv.insert(argv.end(), {"--serve-fd", std::to_string(kFirstInheritedFd)});
  return argv;
}

ResidentProvider::ResidentProvider(Options options)
    : log_(options.log), process_([&] {
        ResidentProcess::Options resident;
        resident.name = std::string(kName);
        resident.argv = options.argv;
        resident.connect_path = options.socket_path;
        resident.log = options.log;
        if (Metrics* metrics = options.metrics) resident.on_restart = [metrics] { metrics->count_provider_restart(); };
        resident.check_hello = [this](std::string_view body) -> Result<void> {
          auto hello = parse_provider_reply(body, kName);
          if (!hello) return fail(hello.error());
          if (hello->op != ProviderOp::hello || !hello->ok)
            return fail(EPROTO, "{}: its first message is \"{}\"{}, not hello", kName, provider_op_name(hello->op),
                        hello->ok ? "" : fmt::format(" refusing ({})", hello->error));
          std::lock_guard lock(mutex_);
          hello_ = *hello;
          have_hello_ = true;
          return {};
        };
        resident.hello_timeout = options.hello_timeout;
        resident.max_frame_bytes = kMaxProviderMessageBytes;
        return resident;
      }()) {}

Result<void> ResidentProvider::ensure_running() { return process_.ensure_running(); }

bool ResidentProvider::takes_shared() const {
  std::lock_guard lock(mutex_);
  return have_hello_ && hello_.takes_shared;
}

bool ResidentProvider::takes_file() const {
  std::lock_guard lock(mutex_);
  return have_hello_ && hello_.takes_file;
}

bool ResidentProvider::takes_cached() const {
  std::lock_guard lock(mutex_);
  return have_hello_ && hello_.takes_cached;
}

unsigned long long ResidentProvider::regions_sent() const {
  std::lock_guard lock(mutex_);
  return regions_sent_;
}

Result<ProviderReply> ResidentProvider::ask(const ProviderRequest& request, std::span<const int> fds,
                                            std::chrono::milliseconds timeout) {
  const uint64_t incarnation = process_.incarnation();
  const std::string op(provider_op_name(request.op));
  auto body = process_.call(encode_provider_request(request), fds, timeout, op);
  if (!body) return fail(body.error());
  auto reply = parse_provider_reply(*body, kName);
  if (!reply)
    return fail(
        process_.lose(incarnation, fmt::format("broke the protocol ({}) and was killed", reply.error().what())));
  if (reply->op != request.op)
    return fail(process_.lose(
        incarnation, fmt::format("answered a {} request with \"{}\" and was killed", op, provider_op_name(reply->op))));
  if (reply->op == ProviderOp::region && reply->ok && reply->region_id != request.region_id)
    return fail(process_.lose(incarnation, fmt::format("answered region {} with region {} and was killed",
                                                       request.region_id, reply->region_id)));
  return reply;
}

Result<void> ResidentProvider::send_region(const ReceivedShare& share, const RegionKey& key,
                                           std::chrono::milliseconds timeout, ProviderRun& run) {
  ProviderRequest request;
  request.op = ProviderOp::region;
  {
    std::lock_guard lock(mutex_);
    request.region_id = ++next_region_id_;
  }
  request.share.share_id = share.share_id;
  request.share.fds = share.entries;
  request.share.header_json = layout::to_json(share.header, false);
  std::vector<int> fds;
  for (const Fd& fd : share.fds) fds.push_back(fd.get());
  const auto start = Clock::now();
  auto reply = ask(request, fds, timeout);
  run.region_sent = true;
  run.region_ms = ms_since(start);
  if (!reply) return fail(reply.error());
  if (!reply->ok)
    return fail(reply->error_errno, "{} (pid {}) refused region {} (share {}): {}", kName, process_.pid(),
                request.region_id, share.share_id, reply->error);
  std::lock_guard lock(mutex_);
  region_incarnation_ = process_.incarnation();
  region_key_ = key;
  region_id_ = request.region_id;
  ++regions_sent_;
  return {};
}

ProviderRun ResidentProvider::prefill(const ProviderRequest& prepared, const ReceivedShare* share,
                                      std::chrono::milliseconds timeout) {
  ProviderRun run;
  const auto start = Clock::now();
  if (auto up = process_.ensure_running(); !up) {
    run.start_error = up.error();
    return run;
  }
  run.started = true;
  const bool shared = prepared.route == PrefillRoute::shared;
  if (shared ? !takes_shared() : !takes_file()) {
    run.started = false;
    run.start_error = Error(ENOTSUP, fmt::format("{} (pid {}) takes no {} route (its hello)", kName, process_.pid(),
                                                 prefill_route_name(prepared.route)));
    return run;
  }
  ProviderRequest request = prepared;
  RegionKey key;
  auto ensure_region = [&](bool again) -> Result<void> {
    if (!shared) return {};
    bool held;
    {
      std::lock_guard lock(mutex_);
      held = !again && region_incarnation_ == process_.incarnation() && region_key_ == key;
    }
    if (!held) {
      if (auto sent = send_region(*share, key, timeout, run); !sent) return sent;
    }
    std::lock_guard lock(mutex_);
    request.region_id = region_id_;
    return {};
  };
  auto finish = [&](const Error& error) {
    run.failure = error.what();
    run.wall_ms = ms_since(start);
    return run;
  };
  if (shared) {
    auto computed = region_key(*share);
    if (!computed) return finish(computed.error());
    key = std::move(*computed);
  }
  if (auto region = ensure_region(false); !region) return finish(region.error());
  auto reply = ask(request, {}, timeout);
  if (reply && !reply->ok && reply->error_errno == ESTALE && shared) {
    // It does not hold the region we think it does (it dropped it, or an earlier region
    // failed on its side): once more with the region.
    if (log_)
      log_(fmt::format("kvshare-serve: {} (pid {}) holds no region {} ({}); sending it again", kName, process_.pid(),
                       request.region_id, reply->error));
    if (auto region = ensure_region(true); !region) return finish(region.error());
    reply = ask(request, {}, timeout);
  }
  if (!reply) return finish(reply.error());
  if (!reply->ok)
    return finish(
        Error(reply->error_errno, fmt::format("{} (pid {}) answered the {} prefill with an error: {}", kName,
                                              process_.pid(), prefill_route_name(request.route), reply->error)));
  run.wall_ms = ms_since(start);
  run.reported_prefill_ms = reply->prefill_ms;
  run.status = ExitStatus{true, 0, 0};
  process_.note_success();
  return run;
}

ProviderRun ResidentProvider::prefill_shared(const ReceivedShare& share, std::span<const int32_t> ids,
                                             uint32_t n_cached, std::chrono::milliseconds timeout) {
  ProviderRequest request;
  request.op = ProviderOp::prefill;
  request.route = PrefillRoute::shared;
  request.share_id = share.share_id;
  request.stream = share.stream;
  request.first_cell = share.first_cell;  // the share's run of cells, if it named one
  request.n_cells = share.n_cells;
  request.n_cached = n_cached;
  request.tokens.assign(ids.begin(), ids.end());
  return prefill(request, &share, timeout);
}

ProviderRun ResidentProvider::prefill_file(std::span<const int32_t> ids, const std::string& state_path,
                                           uint32_t state_version, const ProviderKvParams& kv,
                                           std::chrono::milliseconds timeout) {
  ProviderRequest request;
  request.op = ProviderOp::prefill;
  request.route = PrefillRoute::file;
  request.state_file = state_path;
  request.state_version = state_version;
  request.kv = kv;
  request.tokens.assign(ids.begin(), ids.end());
  return prefill(request, nullptr, timeout);
}

}  // namespace kvshare::route
