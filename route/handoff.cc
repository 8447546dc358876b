#include "route/handoff.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <utility>

#include "kvshare/env.h"
#include "kvshare/share/broker.h"
#include "layout/state_format.h"
#include "route/handoff_steps.h"
#include "route/remote_handoff.h"
#include "route/remote_state.h"
#include "route/resident_provider.h"
#include "route/state_version_probe.h"

namespace kvshare::route {
namespace {

using Json = nlohmann::json;

std::atomic<uint64_t> g_request_sequence{0};

// A file in the slot directory that is gone when the request is done, however it ends.
struct ScopedFile {
  std::filesystem::path path;
  ~ScopedFile() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove(path, ec);
  }
};

// One request counted in HandoffContext::handoffs_in_flight from its decision to its end
// (or until leave()); ahead() is how many were counted before it.
class InFlight {
 public:
  explicit InFlight(std::atomic<size_t>& count) : count_(&count), ahead_(count.fetch_add(1)) {}
  ~InFlight() { leave(); }
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;
  void leave() {
    if (count_) std::exchange(count_, nullptr)->fetch_sub(1);
  }
  size_t ahead() const { return ahead_; }

 private:
  std::atomic<size_t>* count_;
  size_t ahead_;
};

// Not part.value("type", ""): value() throws when "type" is there but not a string.
bool is_text_part(const Json& part) {
  if (!part.is_object()) return false;
  const auto type = part.find("type");
  const auto text = part.find("text");
  return type != part.end() && type->is_string() && type->get_ref<const std::string&>() == "text" &&
         text != part.end() && text->is_string();
}

bool is_text_content(const Json& content) {
  if (content.is_string() || content.is_null()) return true;
  if (!content.is_array()) return false;
  for (const Json& part : content)
    if (!is_text_part(part)) return false;
  return true;
}

// The prompt text the decoder will tokenize, or why there is none.
Result<std::string> prompt_text(const HandoffContext& context, Endpoint endpoint, const Json& request) {
  auto own = request_prompt(endpoint, request);
  if (!own) return fail(own.error());
  if (*own) return std::move(**own);
  auto text = context.decoder->apply_template(request);
  if (!text) return fail(EPROTO, "{}", text.error().what());
  return *text;
}

Result<void> write_ids_file(const std::filesystem::path& path, std::span<const int32_t> ids) {
  std::string text;
  text.reserve(ids.size() * 6);
  for (int32_t id : ids) {
    text += std::to_string(id);
    text += '\n';
  }
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  out.close();
  if (!out) return fail(EIO, "writing the ids file {}", path.string());
  return {};
}

// The file route's KV params, for a resident provider (the per-request one gets flags).
ProviderKvParams provider_kv_params(const ServeConfig& config) {
  ProviderKvParams kv;
  kv.n_ctx = static_cast<uint32_t>(std::max(config.ctx_size, 0));
  kv.type_k = config.cache_type_k;
  kv.type_v = config.cache_type_v;
  kv.flash_attn = layout::parse_flash_attn(config.flash_attn).value_or(true);  // validate() refused a bad one
  kv.n_seq_max = static_cast<uint32_t>(config.parallel);
  kv.kv_unified = decoder_kv_unified(config);
  return kv;
}

// Why a provider run failed, for the fallback line: "the provider exit code 3 (PROG)", or a
// resident provider's own sentence ("the resident provider (pid 4121) did not answer ...").
std::string provider_failure(const ProviderRun& run, const ServeConfig& config) {
  if (provider_is_resident(config))
    return fmt::format("{} ({})", run.started ? run.describe() : run.start_error.what(), provider_name(config));
  return fmt::format("the provider {} ({})", run.describe(), config.prefill_provider);
}

void note_provider_phases(HandoffReport& report, const ProviderRun& run) {
  report.phases.provider_ms += run.wall_ms;
  report.phases.region_ms += run.region_ms;
}

// The provider's own words belong on serve's stderr, on both routes.
void log_provider_stderr(const HandoffContext& context, const ProviderRun& run) {
  std::string text = run.err;
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  if (!text.empty()) context.log(text);
}

std::string version_mismatch_reason(const ServeConfig& config, uint32_t file_version, uint32_t decoder_version) {
  return fmt::format(
      "the provider wrote state version {} ({}), the decoder restores version {} only; the provider "
      "should follow {} or --state-version",
      file_version, provider_name(config), decoder_version, kStateVersionEnv);
}

// The decoder refused a restore. When its version was unknown (the probe at start failed),
// the refusal names neither version, so the file's header and a second probe say whether
// two versions met (llama-server empties the slot on a refused restore, so that save is
// small); what the probe learns is kept for later providers.
StepResult restore_refused(const HandoffContext& context, const std::filesystem::path& state_path,
                           const std::string& refusal) {
  if (context.decoder_state_version.load() != 0) return forward_because("restore_failed", refusal);
  auto file_version = read_state_file_version(state_path);
  if (!file_version)
    return forward_because("restore_failed", fmt::format("{}; the file's state version is unreadable too ({})", refusal,
                                                         file_version.error().what()));
  auto decoder_version = probe_decoder_state_version(*context.decoder, context.slot_dir);
  if (!decoder_version)
    return forward_because(
        "restore_failed",
        fmt::format("{}; the provider wrote state version {} ({}), the decoder's version is "
                    "unknown ({})",
                    refusal, *file_version, context.config->prefill_provider, decoder_version.error().what()));
  context.decoder_state_version.store(*decoder_version);
  context.log(
      fmt::format("kvshare-serve: the decoder restores state files of version {} (probed after a refused "
                  "restore); file-route providers get {}={}",
                  *decoder_version, kStateVersionEnv, *decoder_version));
  if (*decoder_version != *file_version)
    return forward_because(
        "state_version_mismatch",
        fmt::format("{}: {}", refusal, version_mismatch_reason(*context.config, *file_version, *decoder_version)));
  return forward_because("restore_failed", refusal);
}

// The restore both state-file routes end with (file_route, remote_state_route): the file
// `state_name` at `state_path` in the slot directory holds `handoff_ids`; checks its version
// word against the decoder's (when known), waits for the slot to be idle, POSTs restore and
// checks that the slot holds exactly the ids. The caller removes the file.
StepResult restore_state_file(const HandoffContext& context, std::span<const int32_t> handoff_ids,
                              const std::string& state_name, const std::filesystem::path& state_path,
                              HandoffReport& report) {
  const ServeConfig& config = *context.config;
  // A decoder refuses a state file of another version with a message that names neither;
  // reading the 8-byte header here says which two versions met.
  if (const uint32_t decoder_version = context.decoder_state_version.load(); decoder_version != 0) {
    auto version = read_state_file_version(state_path);
    if (!version) return forward_because("bad_state_file", version.error().what());
    if (*version != decoder_version)
      return forward_because("state_version_mismatch", version_mismatch_reason(config, *version, decoder_version));
  }
  // The restore must not land while an earlier request still decodes (llama-server defers
  // it by itself; waiting here keeps any decoder honest).
  if (!context.slot->wait_idle(report.slot, provider_timeout(config)))
    return forward_because("decoder_busy", fmt::format("the decoder was still generating an earlier reply {} ms "
                                                       "after the state file was ready; no restore under it",
                                                       provider_timeout(config).count()));
  const Json body = {{"filename", state_name}, {"leave_one_token", true}};
  const auto restore_start = std::chrono::steady_clock::now();
  auto restored = context.decoder->slot_action("restore", body, report.slot);
  const double restore_wall_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - restore_start).count();
  if (!restored) return forward_because("restore_failed", restored.error().what());
  if (!restored->ok())
    return restore_refused(context, state_path,
                           fmt::format("POST /slots/{}?action=restore answered {}: {}", report.slot, restored->status,
                                       restored->error_message));
  const Json& n_restored = restored->body["n_restored"];
  if (!n_restored.is_number_integer() || n_restored.get<int64_t>() != static_cast<int64_t>(handoff_ids.size())) {
    const bool erased = erase_slot(context, report.slot);
    return forward_because("restore_short",
                           fmt::format("the slot holds {} tokens after the restore, expected {} (the prompt less its "
                                       "last token)",
                                       n_restored.dump(), handoff_ids.size()),
                           !erased);
  }
  report.handoff_ms = restored->timings_ms().value_or(restore_wall_ms);
  report.phases.handoff_ms = restore_wall_ms;
  return {Step::handed_off, "", ""};
}

StepResult file_route(const HandoffContext& context, std::span<const int32_t> handoff_ids,
                      const std::filesystem::path& ids_path, uint64_t sequence, HandoffReport& report) {
  const std::string state_name = fmt::format("kvshare-request-{}.state", sequence);
  ScopedFile state{context.slot_dir / state_name};
  const ServeConfig& config = *context.config;
  std::vector<std::string> env;
  const uint32_t decoder_version = context.decoder_state_version.load();
  if (decoder_version != 0) env.push_back(fmt::format("{}={}", kStateVersionEnv, decoder_version));
  const ProviderRun run = context.resident_provider
                              ? context.resident_provider->prefill_file(
                                    handoff_ids, std::filesystem::absolute(state.path).string(), decoder_version,
                                    provider_kv_params(config), provider_timeout(config))
                              : run_provider(file_provider_command(config, ids_path.string(), state.path.string()), {},
                                             provider_timeout(config), std::move(env));
  log_provider_stderr(context, run);
  note_provider_phases(report, run);
  report.prefill_ms = run.prefill_ms();
  if (!run.ok())
    return forward_because(run.timed_out ? "provider_timeout" : "provider_failed", provider_failure(run, config));
  context.rates.observe_provider(0, handoff_ids.size(), run.prefill_ms(), run.wall_ms);
  report.n_prefilled = handoff_ids.size();
  std::error_code ec;
  if (!std::filesystem::is_regular_file(state.path, ec) || std::filesystem::file_size(state.path, ec) == 0)
    return forward_because("no_state_file",
                           fmt::format("the provider exited 0 but wrote no state file {}", state.path.string()));
  return restore_state_file(context, handoff_ids, state_name, state.path, report);
}

// The remote route's state variant (docs/remote.md, "A stock llama-server across hosts"):
// the provider server at `url` prefills the ids and answers a state file bound to the model,
// the tokenizer, the state version, the ids and the KV types; serve checks the binding
// against its own, writes the file to the slot directory and restores it as file_route does.
// Nothing touches the decoder before the restore, so every failure before it is a plain
// forward; a refused binding is remote_state_refused, naming the field.
StepResult remote_state_route(const HandoffContext& context, std::span<const int32_t> handoff_ids,
                              const std::string& url, uint64_t sequence, HandoffReport& report) {
  const ServeConfig& config = *context.config;
  auto identity = model_identity(config.model);
  if (!identity) return forward_because("remote_state_refused", identity.error().what());
  const uint32_t known_version = context.decoder_state_version.load();
  auto expected = expected_state_binding(
      *identity, config, known_version != 0 ? known_version : layout::kStateSeqVersionLatest, handoff_ids);
  if (!expected) return forward_because("remote_state_refused", expected.error().what());
  const std::string state_name = fmt::format("kvshare-remote-{}.state", sequence);
  ScopedFile state{context.slot_dir / state_name};
  auto fetched = fetch_remote_state(url, config.prefill_remote_key, provider_timeout(config), handoff_ids, *expected,
                                    state.path, static_cast<uint32_t>(config.parallel), decoder_kv_unified(config));
  if (!fetched)
    return forward_because(fetched.error().errno_value() == EINVAL ? "remote_state_refused" : "remote_provider_failed",
                           fetched.error().what());
  report.prefill_ms = fetched->prefill_ms;
  report.kv_bytes = fetched->state_bytes;
  report.phases.provider_ms += fetched->fetch_ms;
  context.rates.observe_provider(0, handoff_ids.size(), fetched->prefill_ms, fetched->fetch_ms);
  report.n_prefilled = handoff_ids.size();
  return restore_state_file(context, handoff_ids, state_name, state.path, report);
}

// The state variant over the prefill hosts in PrefillHosts' order: a host that did not
// answer, failed or sent a state file of another binding is the host's fault, and nothing
// touched the decoder yet, so the next host is asked; a fault of the restore ends it.
StepResult remote_state_handoff(const HandoffContext& context, std::span<const int32_t> handoff_ids, uint64_t sequence,
                                HandoffReport& report) {
  return walk_prefill_hosts(
      context, report,
      [&](size_t host, size_t) {
        PrefillHosts::Lease lease(*context.prefill_hosts, host);
        StepResult tried = remote_state_route(context, handoff_ids, context.prefill_hosts->url(host), sequence, report);
        const bool at_fault = tried.reason == "remote_state_refused" || tried.reason == "remote_provider_failed";
        return HostAttempt{std::move(tried), at_fault, false};
      },
      false);
}

}  // namespace

std::vector<std::string> shared_provider_flags(const ReceivedShare& share, size_t n_cached) {
  std::vector<std::string> flags;
  // The slot's stream; stream 0 goes unsaid, so a provider from before streams serves -np 1.
  if (share.stream > 0) flags.insert(flags.end(), {"--stream", std::to_string(share.stream)});
  // The share's run of cells, only when it named one: a provider from before ranges
  // serves every share that names none.
  if (share.n_cells > 0)
    flags.insert(flags.end(),
                 {"--first-cell", std::to_string(share.first_cell), "--cells", std::to_string(share.n_cells)});
  if (n_cached > 0) flags.insert(flags.end(), {"--cached", std::to_string(n_cached)});
  return flags;
}

std::string share_range_shortfall(const ReceivedShare& share, size_t n_ids) {
  if (share.n_cells == 0 || share.n_cells >= n_ids) return "";
  return fmt::format("the share names cells {}..{} of stream {} ({} cells), fewer than the {} tokens handed over",
                     share.first_cell, uint64_t{share.first_cell} + share.n_cells - 1, share.stream, share.n_cells,
                     n_ids);
}

namespace {

StepResult shared_route(const HandoffContext& context, std::span<const int32_t> handoff_ids,
                        const std::filesystem::path& ids_path, uint64_t sequence, HandoffReport& report) {
  const ServeConfig& config = *context.config;
  // The socket goes in serve's own 0700 slot directory, named for this request: no
  // directory is made and removed per request.
  auto broker = ShareBroker::listen_in(context.slot_dir, fmt::format("kvshare-share-{}.sock", sequence));
  if (!broker)
    return {Step::take_file_route, "handshake_failed",
            fmt::format("the handshake cannot start ({})", broker.error().what())};
  // The provider writes into the slot's own cells: nothing may still decode from them.
  if (!context.slot->wait_idle(report.slot, provider_timeout(config)))
    return {Step::take_file_route, "decoder_busy", "the decoder is still generating an earlier reply"};
  const auto share_start = std::chrono::steady_clock::now();
  // With the ids the decoder answers how many of them its slot holds (n_cached) and keeps
  // those cells; a decoder that does not know the field answers without it: nothing held.
  auto shared = context.decoder->slot_action(
      "share", Json{{"socket", broker->socket_path()}, {"tokens", ids_json(handoff_ids)}}, report.slot);
  if (!shared) return {Step::take_file_route, "handshake_failed", shared.error().what()};
  if (!shared->ok())
    return {Step::take_file_route, "share_refused",
            fmt::format("the decoder refused to share ({}: {})", shared->status, shared->error_message)};
  auto share = broker->receive(static_cast<int>(context.handshake_timeout.count()));
  if (!share)
    return {Step::take_file_route, "handshake_failed",
            fmt::format("receiving the decoder's fds failed ({})", share.error().what())};
  const uint64_t share_id = share->share_id;
  const double share_wall_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - share_start).count();
  // The message on the socket must be the share this request asked for: an earlier
  // share's message replayed into the broker carries an id the decoder no longer adopts.
  // A reply without its share_id cannot be matched, so it is refused the same way.
  if (!shared->body.contains("share_id") || !shared->body["share_id"].is_number_unsigned())
    return {Step::take_file_route, "handshake_failed",
            fmt::format("the share reply has no share_id to match the message on the socket (share_id {})", share_id)};
  if (shared->body["share_id"].get<uint64_t>() != share_id)
    return {Step::take_file_route, "handshake_failed",
            fmt::format("the share reply says share_id {}, the message on the socket says {}",
                        shared->body["share_id"].dump(), share_id)};

  size_t n_cached = 0;
  if (const auto held = shared->body.find("n_cached"); held != shared->body.end()) {
    if (!held->is_number_unsigned() || held->get<uint64_t>() > handoff_ids.size())
      return {Step::take_file_route, "handshake_failed",
              fmt::format("the share reply's n_cached {} is not a count of at most the {} tokens handed over",
                          held->dump(), handoff_ids.size())};
    n_cached = static_cast<size_t>(held->get<uint64_t>());
  }
  if (!(context.resident_provider ? context.resident_provider->takes_cached() : context.provider_takes_cached.load()))
    n_cached = 0;
  report.phases.share_ms = share_wall_ms;
  // A share of a run of cells (a unified cache: the cells the decoder reserved for the
  // sequence) must hold every id handed over; no provider has written anything yet.
  if (std::string shortfall = share_range_shortfall(*share, handoff_ids.size()); !shortfall.empty())
    return {Step::take_file_route, "share_range_short", shortfall};
  // A unified cache's share never has cached cells (the decoder answers n_cached 0).
  if (share->first_cell > 0) n_cached = 0;

  // From here the provider may write into the region: no file route, only forwarding.
  // Cells 0..n_cached-1 are the decoder's own and stay as they are; the provider reads them
  // and writes the rest (docs/provider.md, --cached). When the slot holds every token there
  // is nothing to write and no provider runs.
  auto run_once = [&](size_t cached) {
    if (context.resident_provider)
      return context.resident_provider->prefill_shared(*share, handoff_ids, static_cast<uint32_t>(cached),
                                                       provider_timeout(config));
    std::vector<std::string> argv = shared_provider_command(config, ids_path.string());
    argv.insert(argv.end(), {"--layout", "{layout}", "--fds", "{fds}"});
    for (std::string& flag : shared_provider_flags(*share, cached)) argv.push_back(std::move(flag));
    return provider_run_from(broker->run_provider(*share, argv, static_cast<int>(provider_timeout(config).count())));
  };
  if (n_cached < handoff_ids.size()) {
    ProviderRun run = run_once(n_cached);
    if (n_cached > 0 && !context.resident_provider && run.started && !run.timed_out && run.status.exited &&
        run.status.code == 2) {
      // A usage error on the flag: an older provider. Whatever it wrote, a whole prefill
      // writes every cell again.
      context.provider_takes_cached = false;
      log_provider_stderr(context, run);
      context.log(fmt::format("hybrid: the provider ({}) exited 2 on --cached {}: it gets whole prompts from now on",
                              provider_name(config), n_cached));
      n_cached = 0;
      run = run_once(0);
    }
    log_provider_stderr(context, run);
    note_provider_phases(report, run);
    report.prefill_ms = run.prefill_ms();
    if (!run.ok()) {
      const bool erased = !run.started || erase_slot(context, report.slot);
      return forward_because(run.timed_out ? "provider_timeout" : "provider_failed", provider_failure(run, config),
                             !erased);
    }
    context.rates.observe_provider(n_cached, handoff_ids.size() - n_cached, run.prefill_ms(), run.wall_ms);
  }
  report.n_cached = n_cached;
  report.n_prefilled = handoff_ids.size() - n_cached;
  const auto adopt_start = std::chrono::steady_clock::now();
  auto adopted = adopt_cells(context, report.slot, handoff_ids, share_id, adopt_start, n_cached);
  if (!adopted) return std::move(adopted.error());
  report.phases.handoff_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - adopt_start).count();
  report.handoff_ms = shared->timings_ms().value_or(share_wall_ms) + *adopted;
  return {Step::handed_off, "", ""};
}

}  // namespace

std::string_view endpoint_path(Endpoint endpoint) {
  return endpoint == Endpoint::chat_completions ? "/v1/chat/completions" : "/v1/completions";
}

size_t slot_context(const HandoffContext& context) {
  if (context.slot_ctx_size != 0) return context.slot_ctx_size;
  const int n_slots = context.slot ? context.slot->n_slots() : 1;
  return static_cast<size_t>(std::max(context.config->ctx_size, 0) / std::max(n_slots, 1));
}

namespace {

// "N prompt tokens", when the slot held some ", P cached", and with several slots ", slot S".
std::string prompt_words(const HandoffReport& report) {
  std::string words = report.n_cached == 0 && !report.decided_forward
                          ? fmt::format("{} prompt tokens", report.n_prompt_tokens)
                          : fmt::format("{} prompt tokens, {} cached", report.n_prompt_tokens, report.n_cached);
  if (report.n_slots > 1) words += fmt::format(", slot {}", report.slot);
  return words;
}

}  // namespace

std::string hybrid_line(const HandoffReport& report, double first_byte_ms) {
  const std::string prefill =
      report.n_cached == 0 ? fmt::format("prefill {:.3f} ms", report.prefill_ms)
                           : fmt::format("prefill {:.3f} ms of {} tokens", report.prefill_ms, report.n_prefilled);
  switch (report.route) {
    case HandoffRoute::shared:
      return fmt::format("hybrid: {}: {}, share {:.3f} ms, first byte {:.3f} ms", prompt_words(report), prefill,
                         report.handoff_ms, first_byte_ms);
    case HandoffRoute::remote:
      return fmt::format("hybrid: {}: {}, share {:.3f} ms remote{}, first byte {:.3f} ms", prompt_words(report),
                         prefill, report.handoff_ms,
                         report.remote_host.empty()
                             ? std::string()
                             : fmt::format(" from {} ({} bytes)", report.remote_host, report.kv_bytes),
                         first_byte_ms);
    case HandoffRoute::remote_state:
      return fmt::format("hybrid: {}: {}, restore {:.3f} ms remote-state, first byte {:.3f} ms", prompt_words(report),
                         prefill, report.handoff_ms, first_byte_ms);
    case HandoffRoute::shared_then_file:
      return fmt::format("hybrid: {}: {}, share 0.000 ms, restore {:.3f} ms, first byte {:.3f} ms",
                         prompt_words(report), prefill, report.handoff_ms, first_byte_ms);
    default:
      return fmt::format("hybrid: {}: {}, restore {:.3f} ms, first byte {:.3f} ms", prompt_words(report), prefill,
                         report.handoff_ms, first_byte_ms);
  }
}

std::string phases_line(const HandoffReport& report, double first_byte_ms) {
  const auto& p = report.phases;
  const double first_token = first_byte_ms - p.tokenize_ms - p.share_ms - p.provider_ms - p.handoff_ms;
  return fmt::format(
      "phases: tokenize {:.3f} ms, share {:.3f} ms, provider {:.3f} ms (region {:.3f} ms), {} {:.3f} ms, "
      "first token {:.3f} ms",
      p.tokenize_ms, p.share_ms, p.provider_ms, p.region_ms,
      report.route == HandoffRoute::shared || report.route == HandoffRoute::remote ? "adopt" : "restore", p.handoff_ms,
      first_token);
}

std::string forwarded_line(const HandoffReport& report, double first_byte_ms) {
  return fmt::format("hybrid: {}: forwarded ({}), first byte {:.3f} ms", prompt_words(report), report.decision,
                     first_byte_ms);
}

Result<std::optional<std::string>> request_prompt(Endpoint endpoint, const Json& request) {
  if (!request.is_object()) return fail(EINVAL, "the request body is not a JSON object");
  if (endpoint == Endpoint::completions) {
    auto prompt = request.find("prompt");
    if (prompt == request.end()) return fail(EINVAL, "no \"prompt\" field");
    if (prompt->is_string()) return prompt->get<std::string>();
    if (prompt->is_array() && prompt->size() == 1 && (*prompt)[0].is_string()) return (*prompt)[0].get<std::string>();
    return fail(EINVAL, "\"prompt\" is not one text string (token ids, several prompts or media)");
  }
  auto messages = request.find("messages");
  if (messages == request.end() || !messages->is_array() || messages->empty())
    return fail(EINVAL, "no \"messages\" array");
  for (size_t i = 0; i < messages->size(); ++i) {
    const Json& message = (*messages)[i];
    if (!message.is_object()) return fail(EINVAL, "messages[{}] is not an object", i);
    if (message.contains("content") && !is_text_content(message["content"]))
      return fail(EINVAL, "messages[{}].content is not text (image or audio parts)", i);
  }
  return std::optional<std::string>();
}

std::string uncached_body(const Json& body, int slot) {
  Json forwarded = body;
  forwarded["id_slot"] = slot;
  forwarded["cache_prompt"] = false;
  return forwarded.dump();
}

std::string as_it_came_body(const std::string& body, int slot, int n_slots) {
  if (n_slots <= 1) return body;
  Json forwarded = Json::parse(body, nullptr, false);
  if (!forwarded.is_object()) return body;
  forwarded["id_slot"] = slot;
  return forwarded.dump();
}

std::string forward_body(const Json& body, int slot) {
  Json forwarded = body;
  forwarded["id_slot"] = slot;
  forwarded["cache_prompt"] = true;
  forwarded["leave_one_token"] = true;
  return forwarded.dump();
}

HandoffReport run_handoff(const HandoffContext& context, Endpoint endpoint, const std::string& body,
                          const TakeSlot& take_slot) {
  HandoffReport report;
  report.body = body;
  report.n_slots = context.slot ? context.slot->n_slots() : 1;
  bool has_slot = false;
  auto take = [&](std::span<const int32_t> ids) {
    if (has_slot) return;
    has_slot = true;
    report.slot = take_slot(ids);
  };
  auto fall_back = [&](const std::string& reason, const std::string& why, bool slot_may_be_stale = false) {
    take({});
    report.route = HandoffRoute::none;
    report.fallback_reason = reason;
    report.slot_may_be_stale = slot_may_be_stale;
    // Only a JSON object reaches a step that can leave the slot stale.
    report.body = slot_may_be_stale ? uncached_body(Json::parse(body), report.slot)
                                    : as_it_came_body(body, report.slot, report.n_slots);
    context.metrics->count_fallback(reason);
    context.log(fmt::format("hybrid: fallback ({}): {}; forwarding the request {} (the decoder prefills it)", reason,
                            why,
                            slot_may_be_stale ? fmt::format("to slot {} with cache_prompt false", report.slot)
                                              : std::string("as it came")));
    return report;
  };

  // A request serve cannot tokenize still reaches a slot: nothing is known of what it holds.
  auto fall_back_unknown = [&](const std::string& reason, const std::string& why) {
    take({});
    context.slot_record(report.slot).forget();
    return fall_back(reason, why);
  };
  const auto tokenize_start = std::chrono::steady_clock::now();
  const Json request = Json::parse(body, nullptr, false);
  if (!request.is_object()) return fall_back_unknown("no_text_prompt", "the request body is not a JSON object");
  if (context.tokenize_gate) context.tokenize_gate->acquire();
  auto text = prompt_text(context, endpoint, request);
  Result<std::vector<int32_t>> ids = fail(EPROTO, "no text prompt to tokenize");
  if (text) ids = context.decoder->tokenize(*text);
  if (context.tokenize_gate) context.tokenize_gate->release();
  if (!text)
    return fall_back_unknown(text.error().errno_value() == EPROTO ? "template_failed" : "no_text_prompt",
                             "no text prompt: " + text.error().message());
  if (!ids) return fall_back_unknown("tokenize_failed", ids.error().what());
  report.n_prompt_tokens = ids->size();
  report.phases.tokenize_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - tokenize_start).count();
  // The slot whose cells hold most of this prompt, among the free ones.
  take(*ids);
  SlotRecord& record = context.slot_record(report.slot);
  if (ids->size() < 2) {
    report.slot_prompt_id = record.remember_prompt(*ids);
    return fall_back("prompt_too_short", fmt::format("the prompt has {} token(s): nothing to hand off before the "
                                                     "last one",
                                                     ids->size()));
  }
  // engine#941: the decoder evaluates the prompt's last token itself.
  const std::span<const int32_t> handoff_ids(ids->data(), ids->size() - 1);

  // Whatever happens next, the slot's prompt is this one: a handoff puts it there, and a
  // forward has the decoder evaluate it.
  const size_t n_cached_estimate = record.estimate_cached(*ids);
  report.slot_prompt_id = record.remember_prompt(*ids);
  HandoffQuestion question;
  question.n_prompt = ids->size();
  question.n_cached = n_cached_estimate;
  question.ctx_size = slot_context(context);
  question.provider_incremental =
      context.config->prefill_remote.empty() && context.config->kv_share &&
      (context.resident_provider ? context.resident_provider->takes_cached() : context.provider_takes_cached.load());
  // The load: the streams a prefill by the decoder would stall, and the handoffs ahead of
  // this one at a resident provider (a per-request provider is a process of its own: no
  // queue). Counting this request in before deciding makes two arrivals at once see each other.
  question.n_decoding = context.slot ? static_cast<size_t>(context.slot->decoding_besides(report.slot)) : 0;
  InFlight in_flight(context.handoffs_in_flight);
  if (context.resident_provider) question.provider_queue = in_flight.ahead();
  const HandoffDecision decision = decide_handoff(context.config->handoff, context.rates.snapshot(), question);
  context.metrics->count_decision(decision.hand_off ? "handoff" : "forward", decision.label);
  if (!decision.hand_off) {
    in_flight.leave();
    report.decided_forward = true;
    report.n_cached = n_cached_estimate;
    report.decision = decision.why;
    report.body = as_it_came_body(body, report.slot, report.n_slots);
    return report;  // as it came: the decoder's own prompt cache finds what it holds
  }
  if (decision.label == "load") {
    context.metrics->count_load_handoff();
    context.log(fmt::format("hybrid: {}: handed off: {}", prompt_words(report), decision.why));
  }

  const uint64_t sequence = ++g_request_sequence;
  ScopedFile ids_file{context.slot_dir / fmt::format("kvshare-request-{}.ids", sequence)};
  if (auto written = write_ids_file(ids_file.path, handoff_ids); !written)
    return fall_back("ids_file_failed", written.error().what());

  if (!context.config->prefill_remote.empty() && context.remote_state) {
    StepResult state = remote_state_handoff(context, handoff_ids, sequence, report);
    context.metrics->count_handoff("remote_state", state.step == Step::handed_off ? "ok" : "forwarded");
    if (state.step != Step::handed_off) return fall_back(state.reason, state.why, state.slot_may_be_stale);
    report.route = HandoffRoute::remote_state;
    report.body = forward_body(request, report.slot);
    return report;
  }
  if (!context.config->prefill_remote.empty()) {
    StepResult remote = remote_handoff(context, handoff_ids, sequence, report);
    if (remote.step == Step::handed_off) {
      report.route = HandoffRoute::remote;
      context.metrics->count_cached_tokens(report.n_cached);
      report.body = forward_body(request, report.slot);
      context.metrics->count_handoff("remote", "ok");
      return report;
    }
    // No local provider: the decoder prefills the prompt itself.
    if (remote.step == Step::forward || !has_local_provider(*context.config)) {
      context.metrics->count_handoff("remote", "forwarded");
      return fall_back(remote.reason, remote.why, remote.slot_may_be_stale);
    }
    context.metrics->count_handoff("remote", "file_fallback");
    context.metrics->count_fallback(remote.reason);
    context.log(fmt::format("hybrid: remote route not taken ({}): {}; this request takes the local provider's route",
                            remote.reason, remote.why));
  }
  bool tried_shared = false;
  if (context.config->kv_share) {
    tried_shared = true;
    StepResult shared = shared_route(context, handoff_ids, ids_file.path, sequence, report);
    if (shared.step == Step::handed_off) {
      report.route = HandoffRoute::shared;
      context.metrics->count_cached_tokens(report.n_cached);
      report.body = forward_body(request, report.slot);
      context.metrics->count_handoff("shared", "ok");
      return report;
    }
    if (shared.step == Step::forward) {
      context.metrics->count_handoff("shared", "forwarded");
      return fall_back(shared.reason, shared.why, shared.slot_may_be_stale);
    }
    context.metrics->count_handoff("shared", "file_fallback");
    report.n_cached = 0;
    context.metrics->count_fallback(shared.reason);
    context.log(fmt::format("hybrid: shared route not taken ({}): {}; this request takes the state-file route",
                            shared.reason, shared.why));
  }
  StepResult file = file_route(context, handoff_ids, ids_file.path, sequence, report);
  if (file.step != Step::handed_off) {
    context.metrics->count_handoff("file", "forwarded");
    return fall_back(file.reason, file.why, file.slot_may_be_stale);
  }
  report.route = tried_shared ? HandoffRoute::shared_then_file : HandoffRoute::file;
  report.body = forward_body(request, report.slot);
  context.metrics->count_handoff("file", "ok");
  return report;
}

}  // namespace kvshare::route
