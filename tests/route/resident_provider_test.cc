// serve's side of a resident provider, against kvshare-fake-resident-provider (the real
// channel, faults on demand): the region goes once per share generation and provider, a
// provider that dies, hangs or breaks the protocol is a failed run with its reason (never
// serve's end) and another is started after the back-off, and a provider reached at a
// socket is killed when it must be. Every wait is for a condition, bounded generously.
#include "route/resident_provider.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <mutex>
#include <thread>

#include "../kvshare/share/share_fixtures.h"
#include "kvshare/handshake/transport.h"
#include "kvshare/region/exporter.h"
#include "support/test_support.h"

namespace kvshare::route {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kTimeout{60000};

std::string fake_program() {
  return (kvshare::testing::tool_path("..") / "tests" / "kvshare-fake-resident-provider").string();
}

// A decoder's share as the broker hands it over: a header and memfd regions, the fds dup'ed.
struct DecoderRegion {
  layout::ShareHeader header = kvshare::testing::small_share_header();
  std::vector<ExportedRegion> regions;
  DecoderRegion() {
    ExportOptions options;
    options.forced = RegionBackend::memfd;
    regions = std::move(*export_regions(header.layout, options));
  }
  ReceivedShare share(uint64_t share_id) const {
    ReceivedShare share;
    share.share_id = share_id;
    share.header = header;
    for (size_t i = 0; i < regions.size(); ++i) {
      handshake::FdEntry entry;
      entry.chunk = static_cast<uint32_t>(i);
      entry.kind = "memfd";
      entry.size_bytes = header.layout.chunks[i].size_bytes;
      entry.layout_hash = header.layout.chunks[i].layout_hash;
      share.entries.push_back(entry);
      share.fds.emplace_back(::fcntl(regions[i].fd.get(), F_DUPFD_CLOEXEC, 3));
    }
    return share;
  }
  // What the fake wrote: the ids, as int32, at the start of chunk 0.
  std::vector<int32_t> first_ids(size_t n) const {
    std::vector<int32_t> ids(n);
    std::memcpy(ids.data(), regions[0].mapping.data(), n * sizeof(int32_t));
    return ids;
  }
};

class ResidentProviderTest : public kvshare::testing::FdLeakCheck {
 protected:
  ResidentProvider::Options options(std::vector<std::string> extra = {}) {
    ResidentProvider::Options o;
    o.argv = resident_provider_command(fake_program(), "model.gguf", "");
    o.argv.insert(o.argv.end(), extra.begin(), extra.end());
    o.metrics = &metrics_;
    o.log = [this](const std::string& line) {
      std::lock_guard lock(mutex_);
      log_.push_back(line);
    };
    return o;
  }

  // Retries ensure_running through the back-off until a provider other than `old_pid` runs.
  static void wait_for_new_provider(ResidentProvider& provider, pid_t old_pid) {
    const bool started = kvshare::testing::wait_until([&] {
      auto up = provider.ensure_running();
      if (!up) {
        EXPECT_EQ(up.error().errno_value(), EAGAIN) << up.error().what();
      }
      return up && provider.pid() > 0 && provider.pid() != old_pid;
    });
    ASSERT_TRUE(started) << "no new provider";
  }

  std::string joined_log() {
    std::lock_guard lock(mutex_);
    std::string all;
    for (const auto& line : log_) all += line + "\n";
    return all;
  }

  Metrics metrics_;
  std::mutex mutex_;
  std::vector<std::string> log_;
};

const std::vector<int32_t> kIds = {5, 6, 7, 8, 9};

// The socket file appears at bind(), a moment before listen(): a provider listens once a
// connect goes through (the fake serves that connection, which ends at once, and accepts
// the next).
bool wait_listening(const std::string& socket) {
  return kvshare::testing::wait_until([&] { return handshake::connect_unix(socket, 1000).has_value(); });
}

TEST_F(ResidentProviderTest, SendsTheRegionOncePerShareGeneration) {
  ResidentProvider provider(options());
  ASSERT_TRUE(provider.ensure_running());
  EXPECT_TRUE(provider.takes_shared());
  EXPECT_TRUE(provider.takes_file());
  EXPECT_TRUE(provider.takes_cached());
  DecoderRegion decoder;
  ProviderRun first = provider.prefill_shared(decoder.share(1), kIds, 0, kTimeout);
  ASSERT_TRUE(first.ok()) << first.describe();
  EXPECT_TRUE(first.region_sent);
  EXPECT_EQ(first.prefill_ms(), 0.5);  // the provider's own figure
  EXPECT_EQ(decoder.first_ids(kIds.size()), kIds);
  // The next share of the same region: only the ids go.
  const std::vector<int32_t> more = {11, 12, 13};
  ProviderRun second = provider.prefill_shared(decoder.share(2), more, 1, kTimeout);
  ASSERT_TRUE(second.ok()) << second.describe();
  EXPECT_FALSE(second.region_sent);
  EXPECT_EQ(decoder.first_ids(more.size()), more);
  EXPECT_EQ(provider.regions_sent(), 1u);
  // A re-export (another memfd): the region goes again.
  DecoderRegion reexported;
  ProviderRun third = provider.prefill_shared(reexported.share(3), kIds, 0, kTimeout);
  ASSERT_TRUE(third.ok()) << third.describe();
  EXPECT_TRUE(third.region_sent);
  EXPECT_EQ(reexported.first_ids(kIds.size()), kIds);
  EXPECT_EQ(provider.regions_sent(), 2u);
  EXPECT_EQ(provider.restarts(), 0u);
}

TEST_F(ResidentProviderTest, SendsTheRegionAgainWhenTheProviderAnswersStale) {
  ResidentProvider provider(options({"--fault", "stale-once"}));
  DecoderRegion decoder;
  ProviderRun run = provider.prefill_shared(decoder.share(1), kIds, 0, kTimeout);
  ASSERT_TRUE(run.ok()) << run.describe();
  EXPECT_EQ(provider.regions_sent(), 2u);
  EXPECT_EQ(decoder.first_ids(kIds.size()), kIds);
  EXPECT_NE(joined_log().find("holds no region"), std::string::npos) << joined_log();
}

TEST_F(ResidentProviderTest, AnErrorReplyIsAFailedRunAndTheProviderStays) {
  ResidentProvider provider(options({"--fault", "fail-prefill"}));
  DecoderRegion decoder;
  ProviderRun failed = provider.prefill_shared(decoder.share(1), kIds, 0, kTimeout);
  ASSERT_FALSE(failed.ok());
  EXPECT_TRUE(failed.started);
  EXPECT_NE(failed.describe().find("prefill failed on demand"), std::string::npos) << failed.describe();
  const pid_t pid = provider.pid();
  ProviderRun next = provider.prefill_shared(decoder.share(2), kIds, 0, kTimeout);
  ASSERT_TRUE(next.ok()) << next.describe();
  EXPECT_EQ(provider.pid(), pid);
  EXPECT_EQ(provider.restarts(), 0u);
}

TEST_F(ResidentProviderTest, AProviderThatDiesIsAReasonAndIsStartedAgain) {
  ResidentProvider provider(options({"--fault", "exit-on-prefill"}));
  ASSERT_TRUE(provider.ensure_running());
  const pid_t first_pid = provider.pid();
  DecoderRegion decoder;
  ProviderRun died = provider.prefill_shared(decoder.share(1), kIds, 0, kTimeout);
  ASSERT_FALSE(died.ok());
  EXPECT_NE(died.describe().find("died during a prefill request"), std::string::npos) << died.describe();
  EXPECT_NE(died.describe().find("exit code 3"), std::string::npos) << died.describe();
  wait_for_new_provider(provider, first_pid);
  EXPECT_EQ(provider.restarts(), 1u);
  EXPECT_NE(metrics_.render().find("kvshare_provider_restarts_total 1"), std::string::npos);
  // The new provider holds no region: it is sent again (the fake dies on each one's first
  // prefill, so this one dies too, after being sent the region).
  ProviderRun again = provider.prefill_shared(decoder.share(2), kIds, 0, kTimeout);
  EXPECT_TRUE(again.region_sent);
}

TEST_F(ResidentProviderTest, AProviderThatHangsIsKilledAtTheTimeout) {
  ResidentProvider provider(options({"--fault", "hang-on-prefill"}));
  DecoderRegion decoder;
  ProviderRun hung = provider.prefill_shared(decoder.share(1), kIds, 0, std::chrono::milliseconds(500));
  ASSERT_FALSE(hung.ok());
  EXPECT_NE(hung.describe().find("did not answer a prefill request within 500 ms and was killed"), std::string::npos)
      << hung.describe();
  EXPECT_NE(hung.describe().find("signal 9"), std::string::npos) << hung.describe();
  EXPECT_EQ(provider.pid(), -1);
}

TEST_F(ResidentProviderTest, AProviderThatBreaksTheProtocolIsKilled) {
  for (const std::string fault : {"garbage-reply", "send-fd"}) {
    ResidentProvider provider(options({"--fault", fault}));
    DecoderRegion decoder;
    ProviderRun broke = provider.prefill_shared(decoder.share(1), kIds, 0, kTimeout);
    ASSERT_FALSE(broke.ok()) << fault;
    EXPECT_NE(broke.describe().find(fault == "send-fd" ? "sent 1 fd(s) on its channel" : "broke the protocol"),
              std::string::npos)
        << fault << ": " << broke.describe();
    EXPECT_EQ(provider.pid(), -1) << fault;
  }
}

TEST_F(ResidentProviderTest, AGarbageHelloIsAFailedStart) {
  ResidentProvider provider(options({"--fault", "garbage-hello"}));
  auto up = provider.ensure_running();
  ASSERT_FALSE(up);
  EXPECT_EQ(up.error().errno_value(), ESRCH);
  EXPECT_NE(up.error().message().find("did not start"), std::string::npos) << up.error().message();
  // Within the back-off: EAGAIN naming the wait.
  auto again = provider.ensure_running();
  ASSERT_FALSE(again);
  EXPECT_EQ(again.error().errno_value(), EAGAIN) << again.error().what();
}

TEST_F(ResidentProviderTest, AProgramThatCannotStartIsAnUnstartedRun) {
  ResidentProvider::Options o = options();
  o.argv[0] = "/nonexistent/provider";
  ResidentProvider provider(std::move(o));
  DecoderRegion decoder;
  ProviderRun run = provider.prefill_shared(decoder.share(1), kIds, 0, kTimeout);
  EXPECT_FALSE(run.started);
  EXPECT_NE(run.describe().find("could not start"), std::string::npos) << run.describe();
}

TEST_F(ResidentProviderTest, TheFileRouteSendsThePathAndTheDecodersKvParams) {
  ResidentProvider provider(options({"--file-only"}));
  kvshare::testing::TempDir dir;
  const std::string path = (dir.path() / "request-1.state").string();
  ProviderKvParams kv;
  kv.n_ctx = 1024;
  kv.type_k = "q8_0";
  kv.type_v = "f16";
  kv.flash_attn = false;
  ProviderRun run = provider.prefill_file(kIds, path, 2, kv, kTimeout);
  ASSERT_TRUE(run.ok()) << run.describe();
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  EXPECT_EQ(line, "tokens 5 n_ctx 1024 type_k q8_0 type_v f16 flash_attn false version 2");
  // It said it takes no shared route: that run is refused before anything is sent.
  DecoderRegion decoder;
  ProviderRun shared = provider.prefill_shared(decoder.share(1), kIds, 0, kTimeout);
  EXPECT_FALSE(shared.started);
  EXPECT_NE(shared.describe().find("takes no shared route"), std::string::npos) << shared.describe();
  EXPECT_EQ(provider.regions_sent(), 0u);
}

// A provider another supervisor runs, listening in a private directory: serve connects,
// checks its uid, and kills it through its pidfd when it hangs.
TEST_F(ResidentProviderTest, ReachesAListeningProviderAndKillsItWhenItHangs) {
  kvshare::testing::TempDir dir;
  ASSERT_EQ(::chmod(dir.path().c_str(), 0700), 0);
  const std::string socket = (dir.path() / "provider.sock").string();
  SpawnOptions spawn_options;
  spawn_options.capture_stdout = true;
  auto child = ChildProcess::spawn({fake_program(), "--serve", socket, "--fault", "hang-on-prefill"}, spawn_options);
  ASSERT_TRUE(child) << child.error().what();
  ASSERT_TRUE(wait_listening(socket));
  ResidentProvider::Options o = options();
  o.argv.clear();
  o.socket_path = socket;
  ResidentProvider provider(std::move(o));
  auto up = provider.ensure_running();
  ASSERT_TRUE(up) << up.error().what();
  EXPECT_EQ(provider.pid(), child->pid());
  DecoderRegion decoder;
  ProviderRun hung = provider.prefill_shared(decoder.share(1), kIds, 0, std::chrono::milliseconds(500));
  ASSERT_FALSE(hung.ok());
  EXPECT_NE(hung.describe().find("killed with signal 9"), std::string::npos) << hung.describe();
  auto finished = child->wait_for(kTimeout);
  ASSERT_TRUE(finished) << finished.error().what();
  EXPECT_FALSE(finished->status.exited);
  EXPECT_EQ(finished->status.signal, SIGKILL);
}

TEST_F(ResidentProviderTest, ServesEveryRequestOfAListeningProviderOverOneConnection) {
  kvshare::testing::TempDir dir;
  ASSERT_EQ(::chmod(dir.path().c_str(), 0700), 0);
  const std::string socket = (dir.path() / "provider.sock").string();
  auto child = ChildProcess::spawn({fake_program(), "--serve", socket}, SpawnOptions{});
  ASSERT_TRUE(child) << child.error().what();
  ASSERT_TRUE(wait_listening(socket));
  DecoderRegion decoder;
  {
    ResidentProvider::Options o = options();
    o.argv.clear();
    o.socket_path = socket;
    ResidentProvider provider(std::move(o));
    for (uint64_t share_id = 1; share_id <= 3; ++share_id) {
      ProviderRun run = provider.prefill_shared(decoder.share(share_id), kIds, 0, kTimeout);
      ASSERT_TRUE(run.ok()) << run.describe();
    }
    EXPECT_EQ(provider.regions_sent(), 1u);
  }
  // serve went away; the provider is still up for the next one.
  EXPECT_FALSE(child->poll_exit());
  child->kill_group();
}

}  // namespace
}  // namespace kvshare::route
