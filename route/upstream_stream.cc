#include "route/upstream_stream.h"

#include <httplib.h>

#include <cerrno>

namespace kvshare::route {

std::shared_ptr<UpstreamStream> UpstreamStream::start(Request request, std::function<void()> on_first_byte) {
  std::shared_ptr<UpstreamStream> stream(new UpstreamStream());
  stream->on_first_byte_ = std::move(on_first_byte);
  // The thread holds a raw pointer: the destructor joins it before anything is freed.
  stream->thread_ =
      std::thread([raw = stream.get(), request = std::move(request)]() mutable { raw->run(std::move(request)); });
  return stream;
}

UpstreamStream::~UpstreamStream() {
  cancel();
  if (thread_.joinable()) thread_.join();
}

void UpstreamStream::mark_first_byte() {
  std::function<void()> callback;
  {
    std::lock_guard lock(mutex_);
    if (first_byte_seen_) return;
    first_byte_seen_ = true;
    callback = std::move(on_first_byte_);
  }
  if (callback) callback();
}

void UpstreamStream::run(Request request) {
  httplib::Client client(request.host, request.port);
  const auto timeout = std::chrono::duration_cast<std::chrono::microseconds>(request.timeout);
  client.set_connection_timeout(std::chrono::seconds(10));
  client.set_read_timeout(timeout);
  client.set_write_timeout(timeout);
  client.set_keep_alive(false);

  httplib::Request call;
  call.method = request.method;
  call.path = request.path;
  if (!request.api_key.empty()) call.set_header("Authorization", "Bearer " + request.api_key);
  if (request.method == "POST") {
    call.body = std::move(request.body);
    call.set_header("Content-Type", request.content_type);
  }
  call.response_handler = [this](const httplib::Response& response) {
    {
      std::lock_guard lock(mutex_);
      head_ = UpstreamHead{response.status, response.get_header_value("Content-Type")};
    }
    changed_.notify_all();
    return true;
  };
  call.content_receiver = [this](const char* data, size_t length, uint64_t, uint64_t) {
    mark_first_byte();
    std::unique_lock lock(mutex_);
    // Backpressure: the decoder waits in TCP while the client catches up.
    if (buffered_bytes_ >= kMaxBufferedBytes && !cancelled_) {
      is_waiting_for_room_ = true;
      changed_.notify_all();
      changed_.wait(lock, [&] { return buffered_bytes_ < kMaxBufferedBytes || cancelled_; });
      is_waiting_for_room_ = false;
    }
    if (cancelled_) return false;
    pieces_.emplace_back(data, length);
    buffered_bytes_ += length;
    changed_.notify_all();
    return true;
  };
  auto result = client.send(call);
  mark_first_byte();
  {
    std::lock_guard lock(mutex_);
    if (!head_) {
      head_ = fail(ECONNREFUSED, "forwarding {} {} to the decoder at {}:{}: no answer ({})", request.method,
                   request.path, request.host, request.port, httplib::to_string(result.error()));
    } else if (!result && !cancelled_) {
      error_ = Error(EIO, fmt::format("forwarding {} {}: the decoder's reply was cut ({})", request.method,
                                      request.path, httplib::to_string(result.error())));
    }
    done_ = true;
  }
  changed_.notify_all();
}

Result<UpstreamHead> UpstreamStream::wait_head() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return head_.has_value(); });
  return *head_;
}

bool UpstreamStream::next(std::string& piece) {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return !pieces_.empty() || done_ || cancelled_; });
  if (pieces_.empty() || cancelled_) return false;
  piece = std::move(pieces_.front());
  pieces_.pop_front();
  buffered_bytes_ -= piece.size();
  lock.unlock();
  changed_.notify_all();  // the reader may be waiting for room
  return true;
}

std::optional<Error> UpstreamStream::transport_error() {
  std::lock_guard lock(mutex_);
  return error_;
}

bool UpstreamStream::wait_for_backpressure() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return is_waiting_for_room_ || done_ || cancelled_; });
  return is_waiting_for_room_;
}

size_t UpstreamStream::buffered_bytes() {
  std::lock_guard lock(mutex_);
  return buffered_bytes_;
}

void UpstreamStream::cancel() {
  {
    std::lock_guard lock(mutex_);
    cancelled_ = true;
  }
  changed_.notify_all();
}

}  // namespace kvshare::route
