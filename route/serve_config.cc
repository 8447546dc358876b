#include "route/serve_config.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "kvshare/env.h"
#include "route/prefill_hosts.h"

namespace kvshare::route {
namespace {

std::string env_or_empty(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "";
}

bool is_executable_file(const std::filesystem::path& path) {
  std::error_code ec;
  return std::filesystem::is_regular_file(path, ec) && ::access(path.c_str(), X_OK) == 0;
}

// Why each refused flag cannot work on this route, said once per flag.
std::string refusal_reason(std::string_view flag) {
  if (flag == "--mtp" || flag == "--dflash")
    return "a drafter would draft over a KV cache it did not compute; the hybrid route hands over the prompt's KV only";
  if (flag == "--mmproj") return "the handoff carries text tokens only, not image/audio embeddings";
  if (flag == "--moe-slots") return "the hybrid decoder runs one slot with the model's own expert placement";
  if (flag == "--embedding" || flag == "--embeddings" || flag == "--reranking" || flag == "--rerank")
    return "a server role is not a decoder: nothing is generated from the handed-over KV";
  if (flag == "--pm") return "the provider and the decoder must hold the same model in one layout";
  return "not supported by the hybrid route";
}

// An "-np" / "--parallel" in `args` (the decoder's flags after `--`) whose value is not
// `parallel`, as it was given.
std::optional<std::string> parallel_in(const std::vector<std::string>& args, int parallel) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    std::string value;
    if ((arg == "-np" || arg == "--parallel") && i + 1 < args.size())
      value = args[i + 1];
    else if (arg.rfind("--parallel=", 0) == 0)
      value = arg.substr(11);
    else
      continue;
    if (value != std::to_string(parallel)) return arg + " " + value;
  }
  return std::nullopt;
}

}  // namespace

ServeEnv read_serve_env() {
  ServeEnv env;
  env.hybrid_prefill = env_or_empty("ONEBIT_HYBRID_PREFILL");
  env.hybrid_elfs = env_or_empty("ONEBIT_HYBRID_ELFS");
  env.kv_share = kv_share_enabled();
  env.path = env_or_empty("PATH");
  return env;
}

void apply_env(ServeConfig& config, const ServeEnv& env) {
  if (config.prefill_provider.empty()) config.prefill_provider = env.hybrid_prefill;
  if (config.elfs_dir.empty()) config.elfs_dir = env.hybrid_elfs;
  config.kv_share = env.kv_share;
}

const std::vector<std::string>& refused_flag_names() {
  static const std::vector<std::string> names = {
      "--mtp", "--dflash", "--mmproj", "--moe-slots", "--embedding", "--embeddings", "--reranking", "--rerank", "--pm"};
  return names;
}

Result<void> validate(const ServeConfig& config) {
  if (config.parallel < 1 || config.parallel > kMaxSlots)
    return fail(EINVAL,
                "--parallel {}: expected 1..{} decoder slots (llama-server's -np; serve needs the number, so "
                "-np -1, llama-server's auto, is not taken)",
                config.parallel, kMaxSlots);
  if (auto parallel = parallel_in(config.backend_extra, config.parallel))
    return fail(EINVAL,
                "backend flag \"{}\" refused: serve hands prompts into the decoder's slots and must know how many; "
                "give -np N to kvshare-serve itself (before --)",
                *parallel);
  if (config.ctx_size > 0 && config.parallel >= 1 && config.ctx_size / config.parallel < 2)
    return fail(EINVAL, "-c {} with -np {}: each slot gets {} cells, too few for a prompt; raise -c", config.ctx_size,
                config.parallel, config.ctx_size / config.parallel);
  if (!config.refused_flags.empty())
    return fail(EINVAL, "{} refused: {}", config.refused_flags.front(), refusal_reason(config.refused_flags.front()));
  for (const std::string& arg : config.backend_extra) {
    const std::string name = arg.substr(0, arg.find('='));
    const auto& refused = refused_flag_names();
    if (std::find(refused.begin(), refused.end(), name) != refused.end())
      return fail(EINVAL, "backend flag {} refused: {}", name, refusal_reason(name));
    for (const char* owned : {"--slot-save-path", "--port", "--host"})
      if (name == owned)
        return fail(EINVAL, "backend flag {} refused: kvshare-serve sets it for the decoder it runs", name);
    // serve must know the key to call the decoder's slot actions, and a key on a command
    // line is readable by every user (/proc/PID/cmdline).
    if (name == "--api-key" || name == "--api-key-file")
      return fail(EINVAL,
                  "backend flag {} refused: give --api-key to kvshare-serve (or set LLAMA_API_KEY); it "
                  "checks its clients with it and passes it to the decoder through the environment",
                  name);
  }
  if (!config.prefill_remote.empty()) {
    if (auto hosts = PrefillHosts::from_urls(config.prefill_remote); !hosts) return fail(hosts.error());
  }
  if (config.prefill_remote.empty() && config.prefill_remote_route != RemoteRouteKind::automatic)
    return fail(EINVAL, "--prefill-remote-route {} without --prefill-remote: there is no remote route to choose",
                remote_route_kind_name(config.prefill_remote_route));
  if (config.provider_resident && config.prefill_provider.empty())
    return fail(EINVAL,
                "--provider-resident needs the provider program: give --prefill-provider PROG (or "
                "ONEBIT_HYBRID_PREFILL)");
  if (config.provider_resident && !config.prefill_provider_socket.empty())
    return fail(EINVAL,
                "--provider-resident and --prefill-provider-socket exclude each other: serve either starts "
                "the resident provider itself or reaches one another supervisor runs");
  if (!config.prefill_provider_socket.empty() && config.prefill_provider_socket.front() != '/')
    return fail(EINVAL, "--prefill-provider-socket {}: expected an absolute path (in a 0700 directory of this user)",
                config.prefill_provider_socket);
  if (config.model.empty()) return fail(EINVAL, "no model: give -m MODEL.gguf");
  std::error_code ec;
  if (!std::filesystem::is_regular_file(config.model, ec))
    return fail(ENOENT, "model {} is not a readable file", config.model.string());
  if (auto kv = layout::apply_kv_flags({}, config.flash_attn, config.cache_type_k, config.cache_type_v); !kv)
    return fail(kv.error());
  if (config.ctx_size <= 0) return fail(EINVAL, "-c {}: the context must be positive", config.ctx_size);
  if (!(config.handoff.stream_weight >= 0) || !std::isfinite(config.handoff.stream_weight))
    return fail(EINVAL,
                "--stream-weight {}: expected a number of 0 or more (how many ms of an arriving request's first "
                "byte one ms of one decoding stream's stall is worth; 0: the load is not weighed)",
                config.handoff.stream_weight);
  if (!(config.provider_timeout_s > 0))
    return fail(EINVAL, "--provider-timeout {}: expected a positive number of seconds", config.provider_timeout_s);
  if (config.port < 0 || config.port > 65535) return fail(EINVAL, "--port {}: expected 0..65535", config.port);
  return {};
}

Result<Backend> resolve_backend(const ServeConfig& config, const std::string& path_env,
                                const std::filesystem::path& serve_dir) {
  auto kind_of = [](const std::filesystem::path& program) {
    return program.filename().string().find("llama-server") != std::string::npos ? BackendKind::llama_server
                                                                                 : BackendKind::kvshare_decoder;
  };
  if (!config.backend.empty()) {
    if (!is_executable_file(config.backend))
      return fail(ENOENT, "--backend {}: not an executable file", config.backend);
    return Backend{kind_of(config.backend), std::filesystem::absolute(config.backend)};
  }
  std::stringstream dirs(path_env);
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    if (dir.empty()) continue;
    const std::filesystem::path candidate = std::filesystem::path(dir) / "llama-server";
    if (is_executable_file(candidate)) return Backend{BackendKind::llama_server, candidate};
  }
  // No silent substitute: the decoder of record is llama-server; the reference decoder
  // (kvshare-decoder) runs only when named, so a missing llama-server is never mistaken
  // for a working deployment (issue #25).
  return fail(ENOENT,
              "no decoder: --backend not given and no llama-server on PATH. kvshare-serve decodes with "
              "llama-server, patched by integrations/llama.cpp for the shared route: "
              "scripts/build-llama-server.sh --with-kvshare builds it and prints its path; pass it as --backend PATH "
              "or put its directory on PATH (the reference decoder runs only when named: --backend {})",
              (serve_dir / "kvshare-decoder").string());
}

Result<void> validate_backend(const ServeConfig& config, const Backend& backend) {
  if (config.parallel > 1 && backend.kind == BackendKind::kvshare_decoder)
    return fail(EINVAL,
                "--parallel {} refused: the decoder {} is kvshare-decoder, which serves one slot; give "
                "--backend PATH/llama-server (or put llama-server on PATH) for several slots, or drop -np",
                config.parallel, backend.program.string());
  return {};
}

std::vector<std::string> backend_command(const ServeConfig& config, const Backend& backend, const std::string& slot_dir,
                                         int port) {
  std::vector<std::string> argv = {backend.program.string(),
                                   "-m",
                                   config.model.string(),
                                   "-np",
                                   std::to_string(config.parallel),
                                   "--slot-save-path",
                                   slot_dir,
                                   "-c",
                                   std::to_string(config.ctx_size),
                                   "-fa",
                                   config.flash_attn,
                                   "-ctk",
                                   config.cache_type_k,
                                   "-ctv",
                                   config.cache_type_v,
                                   "--host",
                                   "127.0.0.1",
                                   "--port",
                                   std::to_string(port)};
  argv.insert(argv.end(), config.backend_extra.begin(), config.backend_extra.end());
  return argv;
}

bool has_local_provider(const ServeConfig& config) {
  return !config.prefill_provider.empty() || !config.prefill_provider_socket.empty();
}

bool provider_is_resident(const ServeConfig& config) {
  return config.provider_resident || !config.prefill_provider_socket.empty();
}

std::string provider_name(const ServeConfig& config) {
  if (!config.prefill_provider_socket.empty())
    return fmt::format("the resident provider at {}", config.prefill_provider_socket);
  if (config.provider_resident) return fmt::format("{} (resident)", config.prefill_provider);
  return config.prefill_provider;
}

std::vector<std::string> file_provider_command(const ServeConfig& config, const std::string& ids_path,
                                               const std::string& state_path) {
  std::vector<std::string> argv = {config.prefill_provider, "--tokens", ids_path, "--out", state_path, "--model",
                                   config.model.string()};
  if (!config.elfs_dir.empty()) argv.insert(argv.end(), {"--elfs", config.elfs_dir});
  // The state file's types and V order must be the decoder's: a provider that was not told
  // writes its defaults, and the restore refuses a mismatch (then the decoder prefills).
  // llama-server's long spellings: every CLI parser takes them.
  if (config.kv_flags_given)
    argv.insert(argv.end(), {"--ctx-size", std::to_string(config.ctx_size), "--flash-attn", config.flash_attn,
                             "--cache-type-k", config.cache_type_k, "--cache-type-v", config.cache_type_v});
  // A state file carries one KV stream per slot of the decoder's cache: with several slots
  // the provider must know how many (always the given count: -c alone does not say it).
  if (config.parallel > 1) {
    argv.insert(argv.end(), {"--parallel", std::to_string(config.parallel)});
    if (decoder_kv_unified(config)) argv.push_back("--kv-unified");
  }
  return argv;
}

bool decoder_kv_unified(const ServeConfig& config) {
  if (config.parallel == 1) return true;  // llama.cpp: one sequence is always unified
  for (const std::string& arg : config.backend_extra) {
    if (arg == "-kvu" || arg == "--kv-unified") return true;
    if (arg == "-no-kvu" || arg == "--no-kv-unified") return false;
  }
  return false;  // llama-server's default when -np is given
}

std::vector<std::string> shared_provider_command(const ServeConfig& config, const std::string& ids_path) {
  std::vector<std::string> argv = {config.prefill_provider, "--tokens", ids_path, "--model", config.model.string()};
  if (!config.elfs_dir.empty()) argv.insert(argv.end(), {"--elfs", config.elfs_dir});
  return argv;
}

std::string join_command(const std::vector<std::string>& argv) {
  std::string line;
  for (const std::string& arg : argv) {
    if (!line.empty()) line += ' ';
    const bool plain = !arg.empty() && arg.find_first_of(" \t\n'\"\\$`*?[]{}()<>|;&!#~") == std::string::npos;
    if (plain) {
      line += arg;
      continue;
    }
    line += '\'';
    for (char c : arg) line += c == '\'' ? std::string("'\\''") : std::string(1, c);
    line += '\'';
  }
  return line;
}

std::chrono::milliseconds provider_timeout(const ServeConfig& config) {
  return std::chrono::milliseconds(static_cast<long long>(config.provider_timeout_s * 1000.0));
}

Result<RemoteRouteKind> parse_remote_route_kind(std::string_view value) {
  if (value == "auto") return RemoteRouteKind::automatic;
  if (value == "ucx") return RemoteRouteKind::ucx;
  if (value == "state") return RemoteRouteKind::state;
  return fail(EINVAL, "--prefill-remote-route {}: expected auto, ucx or state", value);
}

std::string_view remote_route_kind_name(RemoteRouteKind kind) {
  switch (kind) {
    case RemoteRouteKind::ucx:
      return "ucx";
    case RemoteRouteKind::state:
      return "state";
    default:
      return "auto";
  }
}

std::string_view device_name(Device device) { return device == Device::hybrid ? "hybrid" : "cpu"; }

std::string_view backend_kind_name(BackendKind kind) {
  return kind == BackendKind::llama_server ? "llama-server" : "kvshare-decoder";
}

Result<RemoteProviderUrl> parse_prefill_remote_url(const std::string& url) {
  constexpr std::string_view kScheme = "http://";
  std::string_view rest = url;
  if (rest.substr(0, kScheme.size()) != kScheme)
    return fail(EINVAL, "--prefill-remote {}: expected http://HOST:PORT", url);
  rest.remove_prefix(kScheme.size());
  if (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
  const size_t colon = rest.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || rest.find('/') != std::string_view::npos)
    return fail(EINVAL, "--prefill-remote {}: expected http://HOST:PORT (a port, no path)", url);
  RemoteProviderUrl out;
  out.host = std::string(rest.substr(0, colon));
  const std::string_view port = rest.substr(colon + 1);
  int value = 0;
  for (char c : port) {
    if (c < '0' || c > '9' || value > 65535)
      return fail(EINVAL, "--prefill-remote {}: port \"{}\" is not a number", url, port);
    value = value * 10 + (c - '0');
  }
  if (port.empty() || value < 1 || value > 65535)
    return fail(EINVAL, "--prefill-remote {}: port \"{}\" is not 1..65535", url, port);
  out.port = value;
  return out;
}

}  // namespace kvshare::route
