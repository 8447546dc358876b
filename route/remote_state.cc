#include "route/remote_state.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <httplib.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>

#include "kvshare/fd.h"
#include "kvshare/mapping.h"
#include "layout/gguf_reader.h"
#include "layout/kv_params.h"
#include "layout/share_header.h"
#include "layout/tensor_type.h"

namespace kvshare::route {
namespace {

using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

Result<void> write_new_file(const std::filesystem::path& path, std::span<const std::byte> bytes) {
  // 0600 and O_EXCL: the slot directory is serve's own, and a file there is never replaced.
  Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!fd) return fail(errno, "creating the state file {}", path.string());
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = n < 0 ? errno : EIO;
      std::error_code ec;
      std::filesystem::remove(path, ec);
      return fail(error, "writing the state file {} ({} of {} bytes written)", path.string(), done, bytes.size());
    }
    done += static_cast<size_t>(n);
  }
  return {};
}

}  // namespace

Result<ModelIdentity> model_identity(const std::filesystem::path& model_path) {
  static std::mutex mutex;
  static std::map<std::filesystem::path, ModelIdentity> known;
  std::lock_guard lock(mutex);
  if (auto it = known.find(model_path); it != known.end()) return it->second;
  auto mapping = Mapping::map_file_readonly(model_path.string());
  if (!mapping) return fail(mapping.error().with_context(fmt::format("model {}", model_path.string())));
  auto gguf = layout::parse_gguf(mapping->bytes(), model_path.string());
  if (!gguf) return fail(gguf.error());
  ModelIdentity identity;
  identity.model_hash = layout::remote_state_hex(
      layout::model_fingerprint_hash(layout::model_fingerprint(gguf->metadata, gguf->tensors)));
  identity.tokenizer_hash = layout::remote_state_hex(layout::tokenizer_fingerprint(gguf->metadata));
  known.emplace(model_path, identity);
  return identity;
}

Result<layout::RemoteStateBinding> expected_state_binding(const ModelIdentity& identity, const ServeConfig& config,
                                                          uint32_t state_version, std::span<const int32_t> ids) {
  auto params = layout::apply_kv_flags(layout::KvParams{}, config.flash_attn, config.cache_type_k, config.cache_type_v);
  if (!params) return fail(params.error());
  layout::RemoteStateBinding binding;
  binding.model = identity.model_hash;
  binding.tokenizer = identity.tokenizer_hash;
  binding.state_version = state_version;
  binding.n_tokens = static_cast<uint32_t>(ids.size());
  binding.tokens_hash = layout::remote_state_hex(layout::remote_state_tokens_hash(ids));
  binding.cache_type_k = std::string(layout::ggml_type_name(params->type_k));
  binding.cache_type_v = std::string(layout::ggml_type_name(params->type_v));
  binding.v_trans = params->v_trans();
  return binding;
}

Result<FetchedState> fetch_remote_state(const std::string& url, const std::string& api_key,
                                        std::chrono::milliseconds timeout, std::span<const int32_t> ids,
                                        const layout::RemoteStateBinding& expected,
                                        const std::filesystem::path& state_path, uint32_t parallel, bool kv_unified) {
  auto where = parse_prefill_remote_url(url);
  if (!where) return fail(where.error());
  httplib::Client client(where->host, where->port);
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(timeout);
  client.set_connection_timeout(us);
  client.set_read_timeout(us);
  client.set_write_timeout(us);
  client.set_keep_alive(false);
  httplib::Headers headers;
  if (!api_key.empty()) headers.emplace("Authorization", "Bearer " + api_key);
  const Json body = {{"tokens", std::vector<int32_t>(ids.begin(), ids.end())},
                     {"binding", layout::remote_state_binding_json(expected)},
                     {"parallel", parallel},
                     {"kv_unified", kv_unified}};
  const auto t0 = Clock::now();
  auto result = client.Post("/prefill-state", headers, body.dump(), "application/json");
  if (!result)
    return fail(result.error() == httplib::Error::Connection ? ECONNREFUSED : EIO,
                "the provider server {}: POST /prefill-state: no answer ({})", url, httplib::to_string(result.error()));
  if (result->status == 401)
    return fail(EACCES,
                "the provider server {} answered 401 ({}): it does not take serve's key "
                "(KVSHARE_REMOTE_KEY or --prefill-remote-key-file)",
                url, error_message_of(result->body));
  if (result->status == 400)
    return fail(EINVAL, "the provider server {} refused the request: {}", url, error_message_of(result->body));
  if (result->status != 200)
    return fail(EPROTO, "the provider server {} answered {}: {}", url, result->status, error_message_of(result->body));
  const std::string& reply = result->body;
  auto payload = layout::parse_remote_state(std::span(reinterpret_cast<const std::byte*>(reply.data()), reply.size()),
                                            fmt::format("the reply of {}", url));
  if (!payload)
    return fail(payload.error().errno_value() == EINVAL ? EPROTO : payload.error().errno_value(), "{}",
                payload.error().message());
  if (auto same = layout::check_binding(expected, payload->binding, fmt::format("the provider server {}", url)); !same)
    return fail(same.error());
  if (auto written = write_new_file(state_path, payload->state); !written) return fail(written.error());
  FetchedState fetched;
  fetched.fetch_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  fetched.prefill_ms = fetched.fetch_ms;
  const std::string reported = result->get_header_value(layout::kRemoteStatePrefillMsHeader);
  double ms = 0;
  if (!reported.empty()) {
    const auto [end, ec] = std::from_chars(reported.data(), reported.data() + reported.size(), ms);
    if (ec == std::errc() && end == reported.data() + reported.size() && ms >= 0) fetched.prefill_ms = ms;
  }
  fetched.payload_bytes = reply.size();
  fetched.state_bytes = payload->state.size();
  return fetched;
}

Result<bool> decoder_speaks_share(const DecoderClient& decoder) {
  // A body without "socket": the patched llama-server and kvshare-decoder refuse it (400
  // naming the socket, or 501 with kv sharing off) before anything is shared; llama-server
  // without the patch answers "Invalid action".
  auto reply = decoder.slot_action("share", Json::object(), 0);
  if (!reply) return fail(reply.error());
  return reply->error_message.find("Invalid action") == std::string::npos;
}

RemoteRouteKind resolve_remote_route(RemoteRouteKind asked, bool decoder_shares) {
  if (asked != RemoteRouteKind::automatic) return asked;
  return decoder_shares ? RemoteRouteKind::ucx : RemoteRouteKind::state;
}

}  // namespace kvshare::route
