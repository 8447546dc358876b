// The decoder's HTTP surface: the subset of llama-server's routes the hybrid route uses
// (docs/decoder.md lists them), on cpp-httplib with a thread pool, like llama-server.
// Every handler answers llama-server's JSON (errors as {"error": {...}} with the status
// in "code"); a handler never lets an exception out (std::invalid_argument -> 400, any
// other -> 500 with its text, as server.cpp ex_wrapper does).
#pragma once

#include <atomic>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "apps/decoder/slot_engine.h"
#include "layout/error.h"

namespace kvshare::decoder {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;                       // 0: any free port (see bound_port())
  std::filesystem::path slot_save_path;  // --slot-save-path; empty: slot actions answer 501
  int n_threads_http = -1;               // -1: max(8, hardware threads - 1)
  std::string model_name;                // what replies call the model (llama-server: -m as given)
  bool endpoint_slots = true;            // GET /slots (--no-slots turns it off)
  // --api-key / --api-key-file: when any is set, every route but /health needs one
  // (route/api_key.h). Slot actions above all: share hands out the KV memory.
  std::vector<std::string> api_keys;
};

class DecoderServer {
 public:
  explicit DecoderServer(ServerOptions options);
  ~DecoderServer();
  DecoderServer(const DecoderServer&) = delete;
  DecoderServer& operator=(const DecoderServer&) = delete;

  // Binds the listening socket (before the model loads, as llama-server does: until
  // attach() every route answers 503 "Loading model"). Fails naming host and port.
  Result<void> bind();
  int bound_port() const;

  // Makes the server ready: requests now reach `engine` (borrowed; must outlive serving).
  void attach(SlotEngine& engine);

  // Serves until stop(). Blocking; call from one thread.
  Result<void> listen();
  // Stops accepting, ends running generations at their next token and returns from
  // listen() once the worker threads are done. Thread-safe; callable before listen().
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvshare::decoder
