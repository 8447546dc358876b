#include "kvshare/stop_signals.h"

#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <thread>

namespace kvshare {
namespace {

// Runs `body` in a forked child (signal dispositions and masks are process state) and
// returns its wait status.
template <class Body>
int in_child(Body body) {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(body());
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

// Regression: kvshare-serve blocked SIGTERM only in the threads it started; a thread a
// library had started before (OpenBLAS's pool, in the ASan build) kept an empty mask, the
// kernel handed it the SIGTERM, and the default action killed serve without its cleanup.
TEST(StopSignals, ASignalReachingAThreadStartedBeforeIsNotedNotFatal) {
  const int status = in_child([] {
    std::atomic<bool> stop{false};
    std::thread early([&] {  // started before install_stop_signals: its mask stays empty
      while (!stop) ::usleep(1000);
    });
    install_stop_signals();
    ::pthread_kill(early.native_handle(), SIGTERM);
    int noted = 0;
    for (int i = 0; i < 500 && noted == 0; ++i) noted = wait_stop_signal(std::chrono::milliseconds(10));
    stop = true;
    early.join();
    return noted == SIGTERM ? 0 : 1;
  });
  ASSERT_TRUE(WIFEXITED(status)) << "the child was killed by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(StopSignals, TakesAProcessSignalBlockedInTheWaitingThread) {
  const int status = in_child([] {
    install_stop_signals();
    ::kill(::getpid(), SIGINT);
    return wait_stop_signal(std::chrono::seconds(5)) == SIGINT ? 0 : 1;
  });
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(StopSignals, ReturnsZeroWhenNothingCame) {
  const int status = in_child([] {
    install_stop_signals();
    return wait_stop_signal(std::chrono::milliseconds(10)) == 0 ? 0 : 1;
  });
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace kvshare
