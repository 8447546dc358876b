// A kvshare-serve a kvshare-bench group runs against (route, conversation): started on a
// free loopback port with its stderr in a file, ready once it names its decoder's port,
// stopped when it goes out of scope; and prompt texts of an exact token count.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "kvshare/share/spawn.h"
#include "route/decoder_client.h"

namespace kvshare::bench {

struct ServeUnderTest {
  ChildProcess process;
  std::filesystem::path stderr_path;
  int port = 0;
  int decoder_port = 0;
  ~ServeUnderTest();
};

struct ServeLaunch {
  std::string name;               // the log file is DIR/serve-NAME.log
  std::vector<std::string> args;  // after kvshare-serve --port P
  bool kv_share = false;          // ONEBIT_KV_SHARE=1 for serve and its decoder
  std::vector<std::string> env;   // NAME=VALUE added to what serve inherits
};

// The first group of `pattern`'s first match in the log file `log`, polled every 50 ms for
// at most two minutes; nullopt when `child` exits first or the time is up.
std::optional<std::string> wait_for_log(const std::filesystem::path& log, const std::regex& pattern,
                                        ChildProcess& child);

// nullptr with `why` set when serve did not start or did not report its decoder.
std::unique_ptr<ServeUnderTest> start_serve(const ServeLaunch& launch, const std::filesystem::path& dir,
                                            std::string& why);

// A private scratch directory holding a generated model (context_length `n_ctx`), once
// kvshare-serve, kvshare-mkmodel and each of `programs` (the decoder, the provider) are
// found; nullopt with `why` set otherwise.
struct BenchModel {
  std::filesystem::path dir;
  std::filesystem::path model;
};
// `mkmodel_args` go to kvshare-mkmodel after the defaults (e.g. {"--layers", "8"}).
std::optional<BenchModel> make_bench_model(const std::string& dir_prefix,
                                           const std::vector<std::filesystem::path>& programs, std::string& why,
                                           const std::vector<std::string>& mkmodel_args = {}, int n_ctx = 8192);

// A prompt text the decoder tokenizes to exactly `n_tokens` (BOS included), starting with
// `salt` so that no two rounds share a cached prefix.
std::string prompt_of(const route::DecoderClient& decoder, int n_tokens, int salt);

// "" when `provider` says it takes --serve-fd (its --help names it), else why it cannot run
// resident (the route and load benches then run it per request only).
std::string resident_support(const std::filesystem::path& provider);

}  // namespace kvshare::bench
