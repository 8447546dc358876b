#include <gtest/gtest.h>

#include "route/handoff.h"

namespace kvshare::route {
namespace {

HandoffReport report(HandoffRoute route) {
  HandoffReport r;
  r.route = route;
  r.n_prompt_tokens = 307;
  r.prefill_ms = 95.1234;
  r.handoff_ms = 6.5;
  return r;
}

TEST(HybridLine, FileRouteSaysRestore) {
  EXPECT_EQ(hybrid_line(report(HandoffRoute::file), 120.0),
            "hybrid: 307 prompt tokens: prefill 95.123 ms, restore 6.500 ms, first byte 120.000 ms");
}

TEST(HybridLine, SharedRouteSaysShare) {
  EXPECT_EQ(hybrid_line(report(HandoffRoute::shared), 99.0005),
            "hybrid: 307 prompt tokens: prefill 95.123 ms, share 6.500 ms, first byte 99.001 ms");
}

TEST(HybridLine, SharedRouteThatFellBackSaysShareZeroThenRestore) {
  EXPECT_EQ(hybrid_line(report(HandoffRoute::shared_then_file), 1.0),
            "hybrid: 307 prompt tokens: prefill 95.123 ms, share 0.000 ms, restore 6.500 ms, first byte 1.000 ms");
}

TEST(HybridLine, RemoteRouteSaysShareThenRemote) {
  EXPECT_EQ(hybrid_line(report(HandoffRoute::remote), 140.0),
            "hybrid: 307 prompt tokens: prefill 95.123 ms, share 6.500 ms remote, first byte 140.000 ms");
}

TEST(HybridLine, RemoteRouteNamesTheHostAndTheBytesItMoved) {
  HandoffReport remote = report(HandoffRoute::remote);
  remote.remote_host = "http://10.0.0.2:8090";
  remote.kv_bytes = 33792;
  remote.n_cached = 97;
  remote.n_prefilled = 33;
  remote.n_slots = 4;
  remote.slot = 2;
  EXPECT_EQ(hybrid_line(remote, 140.0),
            "hybrid: 307 prompt tokens, 97 cached, slot 2: prefill 95.123 ms of 33 tokens, share 6.500 ms remote from "
            "http://10.0.0.2:8090 (33792 bytes), first byte 140.000 ms");
}

TEST(ForwardBody, SetsSlotZeroCachePromptAndLeaveOneTokenKeepingTheRest) {
  const auto body = nlohmann::json::parse(forward_body(
      {{"messages", nlohmann::json::array()}, {"id_slot", 3}, {"cache_prompt", false}, {"max_tokens", 8}}));
  EXPECT_EQ(body["id_slot"], 0);
  EXPECT_EQ(body["cache_prompt"], true);
  EXPECT_EQ(body["leave_one_token"], true);
  EXPECT_EQ(body["max_tokens"], 8);
}

}  // namespace
}  // namespace kvshare::route
