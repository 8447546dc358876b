#include "bench_serve.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <regex>
#include <thread>

#include "bench_files.h"
#include "route/decoder_process.h"

namespace kvshare::bench {

namespace fs = std::filesystem;

ServeUnderTest::~ServeUnderTest() { process.terminate(std::chrono::seconds(10)); }

std::optional<std::string> wait_for_log(const fs::path& log, const std::regex& pattern, ChildProcess& child) {
  for (int i = 0; i < 2400; ++i) {
    std::smatch match;
    const std::string text = read_all(log);
    if (std::regex_search(text, match, pattern)) return match[1].str();
    if (child.poll_exit()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return std::nullopt;
}

std::unique_ptr<ServeUnderTest> start_serve(const ServeLaunch& launch, const fs::path& dir, std::string& why) {
  auto serve = std::make_unique<ServeUnderTest>();
  auto port = route::pick_free_loopback_port();
  if (!port) {
    why = port.error().what();
    return nullptr;
  }
  serve->port = *port;
  serve->stderr_path = dir / ("serve-" + launch.name + ".log");
  std::vector<std::string> argv = {bin("kvshare-serve").string(), "--port", std::to_string(serve->port)};
  argv.insert(argv.end(), launch.args.begin(), launch.args.end());
  // The child takes serve's environment: ONEBIT_KV_SHARE only where asked for.
  if (launch.kv_share)
    ::setenv("ONEBIT_KV_SHARE", "1", 1);
  else
    ::unsetenv("ONEBIT_KV_SHARE");
  SpawnOptions options;
  options.stderr_path = serve->stderr_path.string();
  options.die_with_parent = true;
  options.env = launch.env;
  auto child = ChildProcess::spawn(argv, options);
  ::unsetenv("ONEBIT_KV_SHARE");
  if (!child) {
    why = child.error().what();
    return nullptr;
  }
  serve->process = std::move(*child);
  if (auto port =
          wait_for_log(serve->stderr_path, std::regex(R"(decoder \S+ on 127\.0\.0\.1:(\d+))"), serve->process)) {
    serve->decoder_port = std::stoi(*port);
    return serve;
  }
  why = fmt::format("kvshare-serve {} did not report its decoder (log {})", launch.name, serve->stderr_path.string());
  return nullptr;
}

std::optional<BenchModel> make_bench_model(const std::string& dir_prefix, const std::vector<fs::path>& programs,
                                           std::string& why, const std::vector<std::string>& mkmodel_args, int n_ctx) {
  for (const char* tool : {"kvshare-serve", "kvshare-mkmodel"})
    if (!fs::exists(bin(tool))) {
      why = fmt::format("{} not built", tool);
      return std::nullopt;
    }
  for (const fs::path& program : programs)
    if (!fs::exists(program)) {
      why = fmt::format("{} does not exist", program.string());
      return std::nullopt;
    }
  auto dir = route::make_private_dir(dir_prefix);
  if (!dir) {
    why = dir.error().what();
    return std::nullopt;
  }
  BenchModel made{*dir, *dir / "tiny.gguf"};
  const std::string command =
      fmt::format("{} {} --ctx {} --seed 3 {} > /dev/null 2>&1", bin("kvshare-mkmodel").string(), made.model.string(),
                  n_ctx, fmt::join(mkmodel_args, " "));
  if (std::system(command.c_str()) != 0) {
    why = "kvshare-mkmodel failed";
    return std::nullopt;
  }
  return made;
}

std::string prompt_of(const route::DecoderClient& decoder, int n_tokens, int salt) {
  std::string text = fmt::format("{} ", salt);
  const char* words[] = {"alpha ", "beta ", "gamma ", "delta ", "x", "y "};
  size_t w = 0;
  while (true) {
    auto ids = decoder.tokenize(text);
    if (!ids || static_cast<int>(ids->size()) >= n_tokens) break;
    const size_t missing = static_cast<size_t>(n_tokens) - ids->size();
    // Add many words at once while far away, one at a time near the target.
    for (size_t k = 0; k < std::max<size_t>(1, missing / 3); ++k) text += words[w++ % 6];
  }
  while (true) {
    auto ids = decoder.tokenize(text);
    if (!ids || static_cast<int>(ids->size()) <= n_tokens) break;
    text.pop_back();
  }
  return text;
}

std::string resident_support(const fs::path& provider) {
  const std::string command = fmt::format("'{}' --help 2>&1", provider.string());
  std::string help;
  if (FILE* out = ::popen(command.c_str(), "r")) {
    char buffer[4096];
    for (size_t got; (got = std::fread(buffer, 1, sizeof buffer, out)) > 0;) help.append(buffer, got);
    ::pclose(out);
  }
  if (help.find("--serve-fd") != std::string::npos) return "";
  return fmt::format("{} has no --serve-fd (its --help does not name it): it runs per request only",
                     provider.filename().string());
}

}  // namespace kvshare::bench
