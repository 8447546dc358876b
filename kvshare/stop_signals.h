// SIGINT and SIGTERM for a server with threads (kvshare-serve, kvshare-decoder): blocked
// in the calling thread, so every thread it starts afterwards inherits the block, and
// taken by one thread that waits for them. A thread a library started before (OpenBLAS
// starts its pool when it is loaded) keeps an empty mask; without a handler the default
// action would kill the process there and skip every cleanup, so a handler notes the
// signal for the waiter instead.
#pragma once

#include <chrono>

namespace kvshare {

// Blocks SIGINT and SIGTERM in the calling thread and installs the noting handler. Call
// once, from the main thread, before starting threads.
void install_stop_signals();

// The stop signal received within `timeout` (SIGINT or SIGTERM), or 0.
int wait_stop_signal(std::chrono::milliseconds timeout);

}  // namespace kvshare
