// What `kvshare-serve` was asked to do: the flags, checked, and the command lines they
// turn into (the decoder child's and the provider's). Pure: no process is started here,
// so every refusal and every command line is a unit test.
#pragma once

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "layout/error.h"
#include "layout/kv_params.h"
#include "route/handoff_policy.h"

namespace kvshare::route {

enum class Device { hybrid, cpu };

// Which program decodes. Both speak llama-server's flags and HTTP API.
enum class BackendKind { llama_server, kvshare_decoder };

// How --prefill-remote reaches the decoder (docs/remote.md): ucx, the provider server
// writes into the decoder's cells (the patched llama-server or kvshare-decoder); state, it
// answers a bound state file the decoder restores (any llama-server); automatic, ucx when
// the decoder answers the share action, else state (learnt at start).
enum class RemoteRouteKind { automatic, ucx, state };
Result<RemoteRouteKind> parse_remote_route_kind(std::string_view value);
std::string_view remote_route_kind_name(RemoteRouteKind kind);

struct ServeConfig {
  std::filesystem::path model;          // -m
  Device device = Device::hybrid;       // --device
  std::string prefill_provider;         // --prefill-provider, else ONEBIT_HYBRID_PREFILL
  bool provider_resident = false;       // --provider-resident: the provider starts once (--serve-fd 3)
  std::string prefill_provider_socket;  // --prefill-provider-socket PATH: a resident provider listening there
  std::vector<std::string>
      prefill_remote;  // --prefill-remote URL, once per prefill host: kvshare-provider-servers (docs/remote.md)
  std::string prefill_remote_key;          // KVSHARE_REMOTE_KEY or --prefill-remote-key-file: the provider server's key
  std::string elfs_dir;                    // ONEBIT_HYBRID_ELFS: adds --elfs DIR to the provider
  std::string host = "127.0.0.1";          // --host (serve's own listening address)
  int port = 8080;                         // --port (0: any free port, printed at start)
  int ctx_size = 4096;                     // -c
  bool kv_flags_given = false;             // -c/-fa/-ctk/-ctv on the command line: the provider gets them too
  double provider_timeout_s = 120;         // --provider-timeout
  HandoffPolicy handoff;                   // --handoff auto|always|never|N, --stream-weight W (route/handoff_policy.h)
  std::string backend;                     // --backend PATH ("" = search)
  bool print_backend = false;              // --print-backend
  bool kv_share = false;                   // ONEBIT_KV_SHARE set and non-empty
  std::vector<std::string> backend_extra;  // after `--`, appended to the decoder's command
  // --api-key (LLAMA_API_KEY), comma-separated: serve's clients need one (route/api_key.h)
  // and serve sends the first to the decoder, which reads the same LLAMA_API_KEY from the
  // environment it inherits (never its command line: /proc/PID/cmdline is world-readable).
  std::vector<std::string> api_keys;

  // -fa, -ctk, -ctv as given, from llama-server's defaults (layout/kv_params.h): the decoder
  // gets them unchanged, `auto` included.
  std::string flash_attn{layout::kDefaultFlashAttn};
  std::string cache_type_k{layout::kDefaultCacheType};
  std::string cache_type_v{layout::kDefaultCacheType};

  // -np / --parallel: the decoder's slots; each request is handed into a free one (one KV
  // stream per slot unless the decoder runs --kv-unified).
  int parallel = 1;
  // Flags that exist only to be refused (--mtp, ...): the refusal names them.
  std::vector<std::string> refused_flags;  // each refused flag as it was given
  // --prefill-remote-route auto|ucx|state: how --prefill-remote reaches the decoder.
  RemoteRouteKind prefill_remote_route = RemoteRouteKind::automatic;
};

// The environment serve reads, captured once (tests pass their own).
struct ServeEnv {
  std::string hybrid_prefill;  // ONEBIT_HYBRID_PREFILL
  std::string hybrid_elfs;     // ONEBIT_HYBRID_ELFS
  bool kv_share = false;       // ONEBIT_KV_SHARE set and non-empty
  std::string path;            // PATH, for finding llama-server
};
ServeEnv read_serve_env();

// Applies the environment (provider, elfs, share switch) under the flags: a flag wins
// over its variable.
void apply_env(ServeConfig& config, const ServeEnv& env);

// The flags serve refuses because the hybrid route cannot honour them, wherever they
// appear (serve's own flags or the backend flags after `--`).
const std::vector<std::string>& refused_flag_names();

// The most decoder slots serve runs (-np).
inline constexpr int kMaxSlots = 256;

// Refuses what the route cannot do, with a message that names the flag and why:
// --parallel/-np outside 1..kMaxSlots, or with --prefill-remote past 1, or given again
// after `--` with another value; --mtp, --dflash, --mmproj, --moe-slots, --embedding(s), --reranking,
// --pm (also inside backend_extra); a missing model; a -fa, -ctk or -ctv value llama-server
// refuses (layout::apply_kv_flags); a non-positive
// -c or --provider-timeout; a negative or non-finite --stream-weight; --prefill-remote-route
// ucx or state without --prefill-remote. EINVAL.
Result<void> validate(const ServeConfig& config);

struct Backend {
  BackendKind kind = BackendKind::kvshare_decoder;
  std::filesystem::path program;
};

// --backend when given (must be an executable file); else `llama-server` on `path_env`.
// Else ENOENT saying how to build the patched llama-server; the reference decoder beside
// serve's own binary (`serve_dir`) is named there but never chosen unasked.
Result<Backend> resolve_backend(const ServeConfig& config, const std::string& path_env,
                                const std::filesystem::path& serve_dir);
// What the chosen decoder cannot do for this config: kvshare-decoder serves one slot, so
// -np N > 1 needs llama-server. EINVAL naming the decoder and the fix.
Result<void> validate_backend(const ServeConfig& config, const Backend& backend);

// The decoder child's argv: program, -m, -np N, --slot-save-path, the KV flags, --host
// 127.0.0.1, --port, then the extra flags.
std::vector<std::string> backend_command(const ServeConfig& config, const Backend& backend, const std::string& slot_dir,
                                         int port);

// Whether the decoder keeps every slot in one KV stream: -np 1, or -kvu after `--`.
bool decoder_kv_unified(const ServeConfig& config);

// A local provider prefills (per request, resident, or at a socket): the shared and file routes.
bool has_local_provider(const ServeConfig& config);
// The local provider runs resident (--provider-resident or --prefill-provider-socket).
bool provider_is_resident(const ServeConfig& config);
// How the log names the local provider: the program, "PROG (resident)" or "the resident
// provider at PATH".
std::string provider_name(const ServeConfig& config);

// The provider's argv for the file route (seed contract):
//   PROGRAM --tokens IDS --out STATE --model M [--elfs DIR]
// plus --ctx-size/--flash-attn/--cache-type-k/--cache-type-v when serve was given any KV flag,
// and --parallel N [--kv-unified] when the decoder has several slots.
std::vector<std::string> file_provider_command(const ServeConfig& config, const std::string& ids_path,
                                               const std::string& state_path);
// The provider's argv for the shared route, before --layout/--fds (the broker adds them):
//   PROGRAM --tokens IDS --model M [--elfs DIR]
std::vector<std::string> shared_provider_command(const ServeConfig& config, const std::string& ids_path);

// argv as one shell-readable line (arguments with spaces or quotes are single-quoted).
std::string join_command(const std::vector<std::string>& argv);

std::chrono::milliseconds provider_timeout(const ServeConfig& config);

// --prefill-remote's URL, "http://HOST:PORT" (an optional trailing "/"): EINVAL naming
// what is wrong (another scheme, no port, a path).
struct RemoteProviderUrl {
  std::string host;
  int port = 0;
};
Result<RemoteProviderUrl> parse_prefill_remote_url(const std::string& url);

std::string_view device_name(Device device);
std::string_view backend_kind_name(BackendKind kind);

}  // namespace kvshare::route
