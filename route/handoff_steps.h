// The steps every handoff route shares (route/handoff.cc, route/remote_handoff.cc): where
// an attempt ended, the slot's erase and adopt. Internal to kvshare_route.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>

#include <nlohmann/json.hpp>
#include <tl/expected.hpp>

#include "route/handoff.h"

namespace kvshare::route {

// Where a handoff attempt ended.
enum class Step { handed_off, take_file_route, forward };
struct StepResult {
  Step step = Step::forward;
  std::string reason;              // metric label
  std::string why;                 // the sentence on stderr
  bool slot_may_be_stale = false;  // the slot could not be erased after its cells may have changed
};

StepResult forward_because(std::string reason, std::string why, bool slot_may_be_stale = false);

nlohmann::json ids_json(std::span<const int32_t> ids);

// The decoder forgets the slot (its cached tokens no longer describe its cells). False when
// it could not: the caller must then keep the decoder from reusing any of the slot's cells.
bool erase_slot(const HandoffContext& context, int slot);

// POST adopt of the slot's cells for `share_id` (the shared routes' last step; the decoder
// keeps cells 0..n_cached-1 as they are): the decoder's adopt time (its own figure, else
// the wall time since `start`), or, when it refused, the forward with the slot erased (a
// provider wrote its cells).
tl::expected<double, StepResult> adopt_cells(const HandoffContext& context, int slot,
                                             std::span<const int32_t> handoff_ids, uint64_t share_id,
                                             std::chrono::steady_clock::time_point start, size_t n_cached = 0);

}  // namespace kvshare::route
