#include "kvshare/stop_signals.h"

#include <pthread.h>
#include <signal.h>

#include <atomic>

namespace kvshare {
namespace {

static_assert(std::atomic<int>::is_always_lock_free);  // what a signal handler may touch
std::atomic<int> g_noted{0};

extern "C" void note_stop_signal(int sig) { g_noted.store(sig, std::memory_order_relaxed); }

sigset_t stop_set() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}

}  // namespace

void install_stop_signals() {
  const sigset_t set = stop_set();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  struct sigaction note {};
  note.sa_handler = note_stop_signal;
  sigemptyset(&note.sa_mask);
  ::sigaction(SIGINT, &note, nullptr);
  ::sigaction(SIGTERM, &note, nullptr);
}

int wait_stop_signal(std::chrono::milliseconds timeout) {
  const sigset_t set = stop_set();
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count();
  const timespec wait{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  const int received = sigtimedwait(&set, nullptr, &wait);
  if (received == SIGINT || received == SIGTERM) return received;
  return g_noted.exchange(0, std::memory_order_relaxed);
}

}  // namespace kvshare
