// One request's handoff (docs/hybrid.md's steps 1-3): template and tokenize on the decoder, take a
// slot, have the provider prefill the prompt less its last token, and put that KV into the
// slot — by
// the shared route (share -> fds -> provider -> adopt) when ONEBIT_KV_SHARE is on, else
// (or when the decoder refuses to share) by the state file and a restore. Any failure
// falls back, says why, and the request is forwarded as it came (to its slot): the reply is
// always the decoder's own, so it is always correct. Where a failed step may have left the
// slot's cells changed under tokens that no longer describe them (a provider that wrote and
// failed, a short restore, a refused adopt), the slot is erased; if even the erase fails
// the request goes to the slot with cache_prompt false, so the decoder recomputes every
// cell of the prompt instead of reusing any. With -np N each slot is one stream of the
// decoder's cache: a handoff writes only its own slot's stream (docs/hybrid.md, "Many slots").
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <semaphore>
#include <span>
#include <string>
#include <vector>

#include "route/decoder_client.h"
#include "route/handoff_policy.h"
#include "route/metrics.h"
#include "route/prefill_hosts.h"
#include "route/provider_run.h"
#include "route/serve_config.h"
#include "route/slot_queue.h"
#include "route/slot_record.h"

namespace kvshare {
struct ReceivedShare;  // kvshare/share/broker.h
}  // namespace kvshare

namespace kvshare::route {

class RemoteReceiverProcess;
class ResidentProvider;

enum class Endpoint { chat_completions, completions };
std::string_view endpoint_path(Endpoint endpoint);

enum class HandoffRoute { none, file, shared, shared_then_file, remote, remote_state };

struct HandoffReport {
  HandoffRoute route = HandoffRoute::none;  // none: forwarded as it came
  std::string fallback_reason;              // metric label when route is none ("" for a plain relay)
  size_t n_prompt_tokens = 0;               // the whole prompt, last token included
  double prefill_ms = 0;                    // the provider's own figure, else its wall time
  double handoff_ms = 0;                    // the decoder's restore, or share + adopt
  std::string body;                         // what to forward
  int slot = 0;                             // the decoder's slot the request took (id_slot)
  int n_slots = 1;                          // the decoder's slots (-np): the lines name the slot when > 1
  bool slot_may_be_stale = false;           // the erase failed: forwarded with cache_prompt false
  size_t n_cached = 0;                      // prompt tokens the decoder's slot held and kept
  size_t n_prefilled = 0;                   // tokens the provider prefilled
  std::string remote_host;                  // the remote route: the prefill host that wrote the cells
  uint64_t kv_bytes = 0;                    // the remote route: KV bytes it moved into the decoder
  // Forwarded because a handoff was not worth it (handoff_policy.h), not because one failed:
  // `decision` is the rule's sentence for the log line.
  bool decided_forward = false;
  uint64_t slot_prompt_id = 0;  // SlotRecord's id of this prompt (0: none recorded)
  std::string decision;
  // Where a handoff's wall time went (phases_line): serve's own measurements.
  struct Phases {
    double tokenize_ms = 0;  // the template and /tokenize on the decoder
    double share_ms = 0;     // POST share and the fds on the socket (shared routes)
    double provider_ms = 0;  // the provider's wall time: a process's start to its reap, or a resident's reply
    double region_ms = 0;    // of provider_ms: sending a resident provider the region
    double handoff_ms = 0;   // adopt, or the restore
  } phases;
  bool handed_off() const { return route != HandoffRoute::none; }
};

// The request's line (exact formats; times with 3 decimals). With P > 0 tokens the slot held,
// "N prompt tokens:" reads "N prompt tokens, P cached:" and "prefill X ms" reads
// "prefill X ms of M tokens" (M = what the provider prefilled); with several slots
// ", slot S" follows the counts ("N prompt tokens, slot 2:"):
//   hybrid: N prompt tokens: prefill X ms, restore Y ms, first byte Z ms
//   hybrid: N prompt tokens: prefill X ms, share Y ms, first byte Z ms
//   hybrid: N prompt tokens: prefill X ms, share 0.000 ms, restore Y ms, first byte Z ms
//   hybrid: N prompt tokens: prefill X ms, share Y ms remote from URL (B bytes), first byte Z ms
// (a remote handoff into a slot that held the whole prompt asked no host: "share Y ms remote")
//   hybrid: N prompt tokens: prefill X ms, restore Y ms remote-state, first byte Z ms
std::string hybrid_line(const HandoffReport& report, double first_byte_ms);
// A request forwarded by decision:
//   hybrid: N prompt tokens, P cached: forwarded (WHY), first byte Z ms
std::string forwarded_line(const HandoffReport& report, double first_byte_ms);

// What a per-request provider is told of `share` after the shared route's command:
// `--stream S` when S > 0 and `--first-cell C --cells N` when the share named a run of
// cells (a unified cache), each only then, so a provider from before streams or ranges
// serves every share that needs neither; `--cached P` when P > 0.
std::vector<std::string> shared_provider_flags(const ReceivedShare& share, size_t n_cached);
// Why the share's run of cells cannot take `n_ids` ids (the file route's reason), "" when
// it can or the share named no range.
std::string share_range_shortfall(const ReceivedShare& share, size_t n_ids);

// The phases of a handed-off request, after its hybrid line ("first token" is what is left of
// the first byte: the decoder's evaluation of the last token and the relay):
//   phases: tokenize T ms, share S ms, provider P ms (region R ms), adopt A ms, first token F ms
std::string phases_line(const HandoffReport& report, double first_byte_ms);

// Writes one whole line to serve's stderr (thread-safe; tests capture it instead).
using LogSink = std::function<void(const std::string& line)>;

// What serve reads of a client's request before asking the decoder anything: for
// /v1/completions the one text prompt; for /v1/chat/completions nullopt once every message
// is an object whose content is text (a string, null or text parts: the decoder's
// template then makes the prompt). EINVAL naming the field for anything else (token ids,
// several prompts, media, not an object). Never throws, whatever JSON a client sent.
Result<std::optional<std::string>> request_prompt(Endpoint endpoint, const nlohmann::json& request);

// The request body with id_slot `slot`, cache_prompt true and leave_one_token true: what the
// decoder gets after a handoff. `body` must be a JSON object.
std::string forward_body(const nlohmann::json& body, int slot = 0);
// The request body with id_slot `slot` and cache_prompt false: the slot's cells may hold
// bytes its cached tokens do not describe, and could not be erased; the decoder evaluates
// the whole prompt again and overwrites them. `body` must be a JSON object.
std::string uncached_body(const nlohmann::json& body, int slot = 0);
// A request forwarded as it came, in slot `slot`: with one slot the body untouched (the
// decoder's only slot takes it), with several the body with id_slot set (a JSON object;
// anything else goes untouched, and the decoder refuses it as it would have).
std::string as_it_came_body(const std::string& body, int slot, int n_slots);

struct HandoffContext {
  const ServeConfig* config = nullptr;
  const DecoderClient* decoder = nullptr;
  std::filesystem::path slot_dir;  // the decoder's --slot-save-path, 0700 (ids, state files, share sockets)
  SlotQueue* slot = nullptr;       // the decoder's slots
  // Requests template and tokenize before they wait for a slot; this bounds how many ask the
  // decoder at once (as many as it has slots): a burst of 32 clients must not open 32
  // connections to a decoder whose listen backlog is httplib's 5 (refused, or a SYN
  // retried a second later). Null: no bound (tests).
  std::unique_ptr<std::counting_semaphore<kMaxSlots>> tokenize_gate;
  Metrics* metrics = nullptr;
  LogSink log;
  std::chrono::milliseconds handshake_timeout{10000};
  // The resident kvshare-remote-receiver, when serve has --prefill-remote (else null).
  RemoteReceiverProcess* remote_receiver = nullptr;
  // The prefill hosts (--prefill-remote, once per host), when serve has any (else null).
  std::unique_ptr<PrefillHosts> prefill_hosts;
  // --prefill-remote takes the state variant (a bound state file, restored): the decoder does
  // not speak the share action, or --prefill-remote-route state (route/remote_state.h).
  bool remote_state = false;
  // The resident provider, when serve has --provider-resident or --prefill-provider-socket
  // (else null: a provider process per request).
  ResidentProvider* resident_provider = nullptr;
  // The state-file version the decoder restores (probed at start), 0 when unknown: then a
  // provider's file goes to the restore unchecked and the decoder's refusal is the check; a
  // refused restore probes again and keeps what it learns (hence mutable, atomic).
  mutable std::atomic<uint32_t> decoder_state_version{0};
  // What serve has measured of the decoder and the provider, and what it believes each slot
  // holds (one record per slot, slot_records[id_slot]): the handoff decision's inputs
  // (handoff_policy.h), updated by every request.
  mutable RateBook rates;
  mutable std::deque<SlotRecord> slot_records = std::deque<SlotRecord>(1);
  SlotRecord& slot_record(int slot) const { return slot_records[static_cast<size_t>(slot)]; }
  // The provider takes --cached (prefills only what the slot does not hold) until it exits 2
  // on the flag: from then on it gets whole prompts.
  mutable std::atomic<bool> provider_takes_cached{true};
  // Each slot's context in cells, as the decoder said at start (GET /props; llama-server caps
  // -c / -np at the model's training context); 0: not learned, -c / -np is assumed.
  size_t slot_ctx_size = 0;
  // Requests that chose a handoff and have not finished it: at a resident provider, which
  // prefills one at a time, the queue a new handoff would wait in.
  mutable std::atomic<size_t> handoffs_in_flight{0};
};

// The context a prompt must fit in one of the decoder's slots: what the decoder said
// (slot_ctx_size), else -c / -np (llama-server splits the context between its slots).
size_t slot_context(const HandoffContext& context);

// Takes a slot for a request whose prompt is `ids` (empty when serve could not tokenize it)
// and returns its id_slot; blocks until one is free. The caller keeps the hold.
using TakeSlot = std::function<int(std::span<const int32_t> ids)>;

// Runs the handoff for `body` (the request as it came): tokenizes it, calls take_slot once,
// and hands off into that slot (report.slot).
HandoffReport run_handoff(const HandoffContext& context, Endpoint endpoint, const std::string& body,
                          const TakeSlot& take_slot);

}  // namespace kvshare::route
