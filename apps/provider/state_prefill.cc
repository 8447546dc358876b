#include "apps/provider/state_prefill.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>

#include "apps/provider/prefill_routes.h"
#include "apps/provider/private_kv.h"
#include "apps/provider/provider_command.h"
#include "kvshare/env.h"
#include "kvshare/statefile/state_file_reader.h"
#include "layout/json_depth.h"
#include "layout/kv_params.h"
#include "layout/memory_shape.h"
#include "layout/share_header.h"
#include "layout/state_format.h"
#include "layout/tensor_type.h"
#include "refmodel/engine.h"
#include "route/decoder_process.h"
#include "route/provider_run.h"
#include "route/state_version_probe.h"

namespace kvshare::refmodel {
namespace {

using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;
constexpr const char* kJsonType = "application/json; charset=utf-8";
// 12 bytes per id is generous for "2147483647,"; a 1M-token prompt stays far below it.
constexpr size_t kMaxBodyBytes = 16u << 20;
constexpr int kMaxBodyDepth = 3;  // {"binding": {...}, "tokens": [...]}
const IdsSource kBodySource{"field \"tokens\"", "", "the context", "", "", ""};

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

StatePrefillAnswer error_answer(int status, const std::string& message) {
  std::fprintf(stderr, "kvshare-provider-server: prefill-state refused (%d): %s\n", status, message.c_str());
  return {status, kJsonType, Json{{"error", Json{{"message", message}, {"code", status}}}}.dump(), 0};
}

// Cells for the private cache: the ids rounded up to llama.cpp's 256-cell padding.
uint32_t cells_for(size_t n_ids) { return static_cast<uint32_t>((n_ids + 255) / 256 * 256); }

struct RemoveDir {
  std::filesystem::path path;
  ~RemoveDir() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove_all(path, ec);
  }
};

}  // namespace

Result<StatePrefillBody> parse_state_prefill_body(std::string_view body) {
  if (body.size() > kMaxBodyBytes)
    return fail(EMSGSIZE, "prefill-state: body is {} bytes, the limit is {}", body.size(), kMaxBodyBytes);
  if (layout::json_nesting_depth(body) > kMaxBodyDepth)
    return fail(EINVAL, "prefill-state: JSON nests deeper than {} levels", kMaxBodyDepth);
  const Json json = Json::parse(body, nullptr, false);
  if (json.is_discarded() || !json.is_object()) return fail(EINVAL, "prefill-state: body is not a JSON object");
  auto tokens = json.find("tokens");
  if (tokens == json.end() || !tokens->is_array() || tokens->empty())
    return fail(EINVAL, "prefill-state: \"tokens\" must be a non-empty array of token ids");
  StatePrefillBody out;
  out.tokens.reserve(tokens->size());
  for (size_t i = 0; i < tokens->size(); ++i) {
    const Json& t = (*tokens)[i];
    if (!t.is_number_unsigned() || t.get<uint64_t>() > static_cast<uint64_t>(INT32_MAX))
      return fail(EINVAL, "prefill-state: tokens[{}] is {}, not a token id", i, t.dump());
    out.tokens.push_back(static_cast<int32_t>(t.get<uint64_t>()));
  }
  auto binding = json.find("binding");
  if (binding == json.end()) return fail(EINVAL, "prefill-state: no \"binding\" (what the decoder expects back)");
  auto parsed = layout::parse_remote_state_binding(*binding, "prefill-state: field \"binding\"");
  if (!parsed) return fail(parsed.error());
  out.binding = std::move(*parsed);
  if (auto parallel = json.find("parallel"); parallel != json.end()) {
    if (!parallel->is_number_unsigned() || parallel->get<uint64_t>() < 1 || parallel->get<uint64_t>() > 256)
      return fail(EINVAL, "prefill-state: \"parallel\" is {}, expected the decoder's slots, 1..256", parallel->dump());
    out.parallel = static_cast<uint32_t>(parallel->get<uint64_t>());
  }
  if (auto unified = json.find("kv_unified"); unified != json.end()) {
    if (!unified->is_boolean())
      return fail(EINVAL, "prefill-state: \"kv_unified\" is {}, expected true or false", unified->dump());
    out.kv_unified = unified->get<bool>();
  }
  if (out.binding.n_tokens != out.tokens.size())
    return fail(EINVAL, "prefill-state: field \"binding.n_tokens\" is {}, the body has {} tokens", out.binding.n_tokens,
                out.tokens.size());
  const std::string hash = layout::remote_state_hex(layout::remote_state_tokens_hash(out.tokens));
  if (out.binding.tokens_hash != hash)
    return fail(EINVAL, "prefill-state: field \"binding.tokens_hash\" is {}, the body's tokens hash to {}",
                out.binding.tokens_hash, hash);
  return out;
}

struct StatePrefiller::Impl {
  ProviderModel model;
  int n_threads = 0;
  std::string model_hash;
  std::string tokenizer_hash;
  std::mutex own_mutex;  // --parallel > 1 runs several answers at once
  PrivateContext own;    // the private cache, kept across requests (under own_mutex)
};

StatePrefiller::StatePrefiller(std::shared_ptr<const Model> model, std::string model_path, int n_threads)
    : impl_(std::make_unique<Impl>()) {
  impl_->model_hash = layout::remote_state_hex(
      layout::model_fingerprint_hash(layout::model_fingerprint(model->metadata(), model->tensor_infos())));
  impl_->tokenizer_hash = layout::remote_state_hex(layout::tokenizer_fingerprint(model->metadata()));
  impl_->model = ProviderModel{std::move(model), std::move(model_path)};
  impl_->n_threads = n_threads;
}

StatePrefiller::~StatePrefiller() = default;

const std::string& StatePrefiller::model_hash() const { return impl_->model_hash; }
const std::string& StatePrefiller::tokenizer_hash() const { return impl_->tokenizer_hash; }

namespace {

// Runs the provider command on the file route's contract and checks what it wrote: the
// asked version and exactly the asked ids. EIO naming the command or the file's fault.
Result<void> run_command_into(const ProviderModel& model, const std::string& command, const std::filesystem::path& dir,
                              const std::filesystem::path& state_path, const layout::KvParams& params, uint32_t version,
                              std::span<const int32_t> ids, std::chrono::milliseconds timeout) {
  if (auto ran = run_provider_command(command, dir, state_path, model.path, params, version, ids, timeout); !ran)
    return fail(ran.error());
  auto written = route::read_state_file_version(state_path);
  if (!written) return fail(EIO, "the provider command's state file: {}", written.error().what());
  if (*written != version)
    return fail(EIO, "the provider command wrote state version {}, the decoder restores {} (it should follow {})",
                *written, version, kStateVersionEnv);
  auto memory = layout::derive_memory_shape(model.model->shape(), params);
  if (!memory) return fail(memory.error());
  auto file = statefile::read_state_file(state_path, &*memory);
  if (!file) return fail(EIO, "the provider command's state file: {}", file.error().what());
  if (!std::equal(file->tokens().begin(), file->tokens().end(), ids.begin(), ids.end()))
    return fail(EIO, "the provider command's state file holds {} other tokens than the {} asked for",
                file->tokens().size(), ids.size());
  return {};
}

}  // namespace

StatePrefillAnswer StatePrefiller::answer(std::string_view body_text, const std::string& provider_command,
                                          std::chrono::milliseconds timeout) {
  auto body = parse_state_prefill_body(body_text);
  if (!body) return error_answer(400, body.error().what());
  const layout::RemoteStateBinding& asked = body->binding;
  // Compatibility first: another model or tokenizer is refused before any compute.
  layout::RemoteStateBinding ours = asked;
  ours.model = impl_->model_hash;
  ours.tokenizer = impl_->tokenizer_hash;
  if (auto same = layout::check_binding(asked, ours, "prefill-state"); !same) {
    const std::string message = fmt::format("{} (model {})", same.error().message(), impl_->model.path);
    return error_answer(400, message);
  }
  if (auto known = check_ids_in_vocabulary(impl_->model, body->tokens, kBodySource); !known)
    return error_answer(400, fmt::format("prefill-state: {}", known.error().what()));
  layout::KvParams params;
  // llama-server's rule: one sequence is always unified; several are not unless -kvu, and
  // then each slot's stream must hold the prompt.
  params.n_seq_max = body->parallel;
  params.kv_unified = body->parallel == 1 || body->kv_unified;
  params.n_ctx = cells_for(body->tokens.size()) * (params.kv_unified ? 1 : body->parallel);
  params.flash_attn = !asked.v_trans;
  // The binding's parse made these canonical ggml type names.
  params.type_k = *layout::parse_cache_type(asked.cache_type_k);
  params.type_v = *layout::parse_cache_type(asked.cache_type_v);
  if (auto valid = layout::validate(params); !valid)
    return error_answer(400, fmt::format("prefill-state: field \"binding\": {}", valid.error().what()));

  const auto t0 = Clock::now();
  auto dir = route::make_private_dir("kvshare-provider-server");
  if (!dir) return error_answer(500, dir.error().what());
  RemoveDir remove_dir{*dir};
  const std::filesystem::path state_path = *dir / "prompt.state";
  if (provider_command.empty()) {
    StateFileTarget target{state_path.string(), params, asked.state_version};
    std::lock_guard own_lock(impl_->own_mutex);
    auto report = prefill_state_file(impl_->model, target, body->tokens, impl_->n_threads, kBodySource, impl_->own);
    if (!report) {
      const int status = report.error().errno_value() == EINVAL || report.error().errno_value() == ERANGE ? 400 : 502;
      return error_answer(status, fmt::format("prefill-state: {}", report.error().what()));
    }
  } else if (auto ran = run_command_into(impl_->model, provider_command, *dir, state_path, params, asked.state_version,
                                         body->tokens, timeout);
             !ran) {
    return error_answer(502, fmt::format("prefill-state: {}", ran.error().what()));
  }
  const double prefill_ms = ms_since(t0);
  std::error_code ec;
  const uint64_t state_bytes = std::filesystem::file_size(state_path, ec);
  if (ec || state_bytes == 0)
    return error_answer(502, fmt::format("prefill-state: no state file {} after the prefill", state_path.string()));
  StatePrefillAnswer answer{200, "application/octet-stream", layout::encode_remote_state_prefix(ours, state_bytes), 0};
  const size_t prefix_bytes = answer.body.size();
  answer.body.resize(prefix_bytes + state_bytes);
  std::ifstream in(state_path, std::ios::binary);
  in.read(answer.body.data() + prefix_bytes, static_cast<std::streamsize>(state_bytes));
  if (!in || static_cast<uint64_t>(in.gcount()) != state_bytes)
    return error_answer(502, fmt::format("prefill-state: reading the state file {} ({} bytes) stopped at byte {}",
                                         state_path.string(), state_bytes, static_cast<uint64_t>(in.gcount())));
  std::fprintf(stderr,
               "kvshare-provider-server: prefill-state: %u tokens, prefill %.3f ms, %llu bytes (state version %u, "
               "%s/%s%s)\n",
               ours.n_tokens, prefill_ms, static_cast<unsigned long long>(answer.body.size()), ours.state_version,
               ours.cache_type_k.c_str(), ours.cache_type_v.c_str(), ours.v_trans ? ", v_trans" : "");
  answer.prefill_ms = prefill_ms;
  return answer;
}

}  // namespace kvshare::refmodel
