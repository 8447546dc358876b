// serve's supervision of kvshare-remote-receiver (the real binary): a receiver that dies,
// hangs or cannot start is a reason, never serve's end, and another is started after the
// back-off. Every wait here is for a condition (a reply, a new pid), bounded generously.
#include "route/remote_receiver_process.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <thread>
#include <vector>

#include "support/test_support.h"

namespace kvshare::route {
namespace {

using Clock = std::chrono::steady_clock;
using layout::ReceiverOp;
using layout::ReceiverRequest;

constexpr std::chrono::milliseconds kCallTimeout{60000};

class RemoteReceiverProcessTest : public kvshare::testing::FdLeakCheck {
 protected:
  RemoteReceiverProcess::Options options(
      std::filesystem::path program = kvshare::testing::tool_path("kvshare-remote-receiver")) {
    RemoteReceiverProcess::Options o;
    o.program = std::move(program);
    o.private_dir = dir_.path();
    o.metrics = &metrics_;
    o.log = [this](const std::string& line) {
      std::lock_guard lock(mutex_);
      log_.push_back(line);
    };
    return o;
  }

  // Retries ensure_running through the back-off until a receiver other than `old_pid` runs.
  static void wait_for_new_receiver(RemoteReceiverProcess& receiver, pid_t old_pid) {
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    while (Clock::now() < deadline) {
      auto up = receiver.ensure_running();
      if (up && receiver.pid() > 0 && receiver.pid() != old_pid) return;
      if (!up) {
        ASSERT_EQ(up.error().errno_value(), EAGAIN) << up.error().what();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));  // polling a condition, not a delay
    }
    FAIL() << "no new receiver within 60 s";
  }

  std::string joined_log() {
    std::lock_guard lock(mutex_);
    std::string all;
    for (const auto& line : log_) all += line + "\n";
    return all;
  }

  kvshare::testing::TempDir dir_;
  Metrics metrics_;
  std::mutex mutex_;
  std::vector<std::string> log_;
};

ReceiverRequest revoke_request() { return ReceiverRequest{.op = ReceiverOp::revoke, .why = "test"}; }

TEST_F(RemoteReceiverProcessTest, StartsTheReceiverWhichAnswersARevokeWithNothingOpen) {
  RemoteReceiverProcess receiver(options());
  auto up = receiver.ensure_running();
  ASSERT_TRUE(up) << up.error().what();
  EXPECT_GT(receiver.pid(), 0);
  auto reply = receiver.call(revoke_request(), kCallTimeout);
  ASSERT_TRUE(reply) << reply.error().what();
  EXPECT_EQ(reply->op, ReceiverOp::revoke);
  EXPECT_TRUE(reply->ok);
  EXPECT_EQ(receiver.restarts(), 0u);
}

TEST_F(RemoteReceiverProcessTest, AnswersAGrantWithoutAListenWithARefusalNotADeath) {
  RemoteReceiverProcess receiver(options());
  ASSERT_TRUE(receiver.ensure_running());
  const pid_t pid = receiver.pid();
  auto reply = receiver.call(
      ReceiverRequest{.op = ReceiverOp::grant, .socket_name = "none.sock", .n_cells = 4, .timeout_ms = 1000},
      kCallTimeout);
  ASSERT_TRUE(reply) << reply.error().what();
  EXPECT_FALSE(reply->ok);
  EXPECT_EQ(reply->error_errno, EINVAL);
  EXPECT_NE(reply->error.find("from socket none.sock: no listen of that name is pending"), std::string::npos)
      << reply->error;
  EXPECT_EQ(receiver.pid(), pid);
}

// serve with -np 4 runs handoffs at once: every thread's call gets its own reply (the
// socket it asked to listen on, then its revoke), none another's.
TEST_F(RemoteReceiverProcessTest, AnswersEachOfSeveralConcurrentCallersWithItsOwnReply) {
  RemoteReceiverProcess receiver(options());
  ASSERT_TRUE(receiver.ensure_running());
  constexpr int kThreads = 8;
  constexpr int kRounds = 5;
  std::mutex m;
  std::condition_variable all_ready;
  int ready = 0;
  std::vector<std::string> failures(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      {
        std::unique_lock lock(m);
        ++ready;
        all_ready.notify_all();
        all_ready.wait(lock, [&] { return ready == kThreads; });
      }
      for (int round = 0; round < kRounds && failures[t].empty(); ++round) {
        const std::string name = fmt::format("slot-{}-{}.sock", t, round);
        auto listened = receiver.call({.op = ReceiverOp::listen, .socket_name = name}, kCallTimeout);
        if (!listened || !listened->ok || listened->op != ReceiverOp::listen ||
            !listened->socket_path.ends_with("/" + name)) {
          failures[t] = listened ? fmt::format("listen {}: {} {}", name, listened->socket_path, listened->error)
                                 : listened.error().what();
          break;
        }
        auto revoked =
            receiver.call({.op = ReceiverOp::revoke, .socket_name = name, .why = "the test's slot"}, kCallTimeout);
        if (!revoked || !revoked->ok || revoked->op != ReceiverOp::revoke)
          failures[t] = revoked ? fmt::format("revoke {}: {}", name, revoked->error) : revoked.error().what();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failures[t], "") << "thread " << t;
  EXPECT_EQ(receiver.restarts(), 0u);
  // Every listen's socket went with its revoke.
  size_t sockets = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir_.path()))
    sockets += entry.path().extension() == ".sock";
  EXPECT_EQ(sockets, 0u);
}

TEST_F(RemoteReceiverProcessTest, NamesTheSignalOfAKilledReceiverAndStartsAnotherAfterTheBackoff) {
  RemoteReceiverProcess receiver(options());
  ASSERT_TRUE(receiver.ensure_running());
  const pid_t first = receiver.pid();
  ASSERT_EQ(::kill(first, SIGSEGV), 0);
  auto reply = receiver.call(revoke_request(), kCallTimeout);
  ASSERT_FALSE(reply);
  EXPECT_EQ(reply.error().errno_value(), ESRCH);
  EXPECT_NE(reply.error().what().find(fmt::format("pid {}", first)), std::string::npos) << reply.error().what();
  // Under ASan the receiver's SIGSEGV is caught and becomes an abort (signal 6).
  EXPECT_TRUE(reply.error().what().find("signal 11") != std::string::npos ||
              reply.error().what().find("signal 6") != std::string::npos)
      << reply.error().what();
  EXPECT_EQ(receiver.pid(), -1);
  wait_for_new_receiver(receiver, first);
  EXPECT_EQ(receiver.restarts(), 1u);
  EXPECT_NE(metrics_.render().find("kvshare_remote_receiver_restarts_total 1"), std::string::npos);
  EXPECT_NE(joined_log().find("started again"), std::string::npos) << joined_log();
  auto after = receiver.call(revoke_request(), kCallTimeout);
  ASSERT_TRUE(after) << after.error().what();
  EXPECT_TRUE(after->ok);
}

TEST_F(RemoteReceiverProcessTest, ReplacesAReceiverThatDiedBetweenRequestsBeforeTheNextOne) {
  RemoteReceiverProcess receiver(options());
  ASSERT_TRUE(receiver.ensure_running());
  const pid_t first = receiver.pid();
  ASSERT_EQ(::kill(first, SIGKILL), 0);
  wait_for_new_receiver(receiver, first);
  EXPECT_NE(joined_log().find("exited between requests: signal 9"), std::string::npos) << joined_log();
  auto reply = receiver.call(revoke_request(), kCallTimeout);
  ASSERT_TRUE(reply) << reply.error().what();
}

TEST_F(RemoteReceiverProcessTest, KillsAReceiverThatDoesNotAnswerAndSaysSo) {
  RemoteReceiverProcess receiver(options());
  ASSERT_TRUE(receiver.ensure_running());
  const pid_t first = receiver.pid();
  ASSERT_EQ(::kill(first, SIGSTOP), 0);
  auto reply = receiver.call(revoke_request(), std::chrono::milliseconds(200));
  ASSERT_FALSE(reply);
  EXPECT_EQ(reply.error().errno_value(), ESRCH);
  EXPECT_NE(reply.error().what().find("did not answer a revoke request within 200 ms and was killed"),
            std::string::npos)
      << reply.error().what();
  EXPECT_EQ(::kill(first, 0), -1);  // reaped: the pid is no longer ours
  wait_for_new_receiver(receiver, first);
}

TEST_F(RemoteReceiverProcessTest, FailsWithEsrchNamingTheProgramWhenTheReceiverCannotStart) {
  RemoteReceiverProcess receiver(options(dir_.path() / "no-such-receiver"));
  auto up = receiver.ensure_running();
  ASSERT_FALSE(up);
  EXPECT_EQ(up.error().errno_value(), ESRCH);
  EXPECT_NE(up.error().what().find("could not start"), std::string::npos) << up.error().what();
  EXPECT_NE(up.error().what().find("no-such-receiver"), std::string::npos) << up.error().what();
  // The next attempt waits for the back-off instead of spinning on exec.
  auto again = receiver.ensure_running();
  ASSERT_FALSE(again);
  EXPECT_TRUE(again.error().errno_value() == EAGAIN || again.error().errno_value() == ESRCH) << again.error().what();
}

}  // namespace
}  // namespace kvshare::route
