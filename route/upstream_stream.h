// One request forwarded to the decoder, read as it arrives: a thread runs the HTTP call
// and queues each piece of the body the moment the decoder sends it, so serve can write it
// to its client at once (SSE bytes go out as the decoder sends them, unchanged). At most
// kMaxBufferedBytes wait in the queue: past that the call's thread stops reading and the
// decoder's writes wait in TCP, so a client that reads slowly costs serve no memory.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "layout/error.h"

namespace kvshare::route {

struct UpstreamHead {
  int status = 0;
  std::string content_type;
};

class UpstreamStream {
 public:
  static constexpr size_t kMaxBufferedBytes = 1 << 20;

  struct Request {
    std::string host;
    int port = 0;
    std::string method;  // "GET" | "POST"
    std::string path;
    std::string body;
    std::string content_type = "application/json";
    std::string api_key;                        // non-empty: sent as "Authorization: Bearer KEY"
    std::chrono::milliseconds timeout{600000};  // per read: a long generation still streams
  };

  // Starts the call. `on_first_byte` runs once, on the call's thread, when the first body
  // byte arrives (or when the call ends without one): the decoder has started on it.
  static std::shared_ptr<UpstreamStream> start(Request request, std::function<void()> on_first_byte);
  ~UpstreamStream();  // cancel() + join

  // Blocks until the decoder's status and headers are in, or the call failed (no answer).
  Result<UpstreamHead> wait_head();
  // Blocks for the next piece of the body; false at its end (or after cancel()).
  bool next(std::string& piece);
  // Whether the call ended in a transport error after the head (a cut stream).
  std::optional<Error> transport_error();
  // Stops reading from the decoder (the client left); the call's thread ends soon after.
  void cancel();
  // Bytes received and not yet taken by next(); never more than kMaxBufferedBytes plus
  // the one piece that crossed it.
  size_t buffered_bytes();
  // Blocks until the call's thread has stopped reading because the queue is full (true)
  // or the call has ended or was cancelled (false): a test of the bound waits for this
  // state, however slowly the machine fills the queue.
  bool wait_for_backpressure();

 private:
  UpstreamStream() = default;
  void run(Request request);
  void mark_first_byte();

  std::mutex mutex_;
  std::condition_variable changed_;
  std::optional<Result<UpstreamHead>> head_;
  std::deque<std::string> pieces_;
  size_t buffered_bytes_ = 0;
  bool done_ = false;
  bool cancelled_ = false;
  bool is_waiting_for_room_ = false;
  std::optional<Error> error_;
  std::function<void()> on_first_byte_;
  bool first_byte_seen_ = false;
  std::thread thread_;
};

}  // namespace kvshare::route
