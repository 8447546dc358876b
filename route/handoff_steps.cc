#include "route/handoff_steps.h"

#include <fmt/format.h>

#include <utility>
#include <vector>

namespace kvshare::route {

using Json = nlohmann::json;

StepResult forward_because(std::string reason, std::string why, bool slot_may_be_stale) {
  return {Step::forward, std::move(reason), std::move(why), slot_may_be_stale};
}

Json ids_json(std::span<const int32_t> ids) { return Json(std::vector<int32_t>(ids.begin(), ids.end())); }

bool erase_slot(const HandoffContext& context, int slot) {
  auto erased = context.decoder->slot_action("erase", Json::object(), slot);
  if (erased && erased->ok()) return true;
  context.metrics->count_fallback("erase_failed");
  context.log(
      fmt::format("hybrid: POST /slots/{0}?action=erase failed ({1}); the request goes to slot {0} with "
                  "cache_prompt false, so the decoder recomputes every cell instead of reusing stale ones",
                  slot, erased ? fmt::format("{}: {}", erased->status, erased->error_message) : erased.error().what()));
  return false;
}

tl::expected<double, StepResult> adopt_cells(const HandoffContext& context, int slot,
                                             std::span<const int32_t> handoff_ids, uint64_t share_id,
                                             std::chrono::steady_clock::time_point start, size_t n_cached) {
  Json body = {{"tokens", ids_json(handoff_ids)}, {"share_id", share_id}, {"leave_one_token", true}};
  // The decoder checks that the cells it said it holds still hold these tokens.
  if (n_cached > 0) body["n_cached"] = n_cached;
  auto adopted = context.decoder->slot_action("adopt", body, slot);
  const double wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (adopted && adopted->ok()) return adopted->timings_ms().value_or(wall_ms);
  const bool erased = erase_slot(context, slot);
  return tl::unexpected(forward_because("adopt_failed",
                                        adopted ? fmt::format("POST /slots/{}?action=adopt answered {}: {}", slot,
                                                              adopted->status, adopted->error_message)
                                                : adopted.error().what(),
                                        !erased));
}

}  // namespace kvshare::route
