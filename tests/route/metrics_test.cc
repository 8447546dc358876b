#include "route/metrics.h"

#include <gtest/gtest.h>

namespace kvshare::route {
namespace {

TEST(Metrics, CountsHandoffsByRouteAndOutcomeAndFallbacksByReason) {
  Metrics metrics;
  metrics.count_handoff("file", "ok");
  metrics.count_handoff("file", "ok");
  metrics.count_handoff("shared", "file_fallback");
  metrics.count_fallback("share_refused");
  const std::string text = metrics.render();
  EXPECT_NE(text.find("kvshare_handoffs_total{route=\"file\",outcome=\"ok\"} 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kvshare_handoffs_total{route=\"shared\",outcome=\"file_fallback\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("kvshare_fallbacks_total{reason=\"share_refused\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE kvshare_handoffs_total counter\n"), std::string::npos);
}

TEST(Metrics, CountsRepliesCutByWhoCutThem) {
  Metrics metrics;
  metrics.count_reply_cut("client");
  metrics.count_reply_cut("client");
  metrics.count_reply_cut("decoder");
  const std::string text = metrics.render();
  EXPECT_NE(text.find("# TYPE kvshare_replies_cut_total counter\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kvshare_replies_cut_total{by=\"client\"} 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kvshare_replies_cut_total{by=\"decoder\"} 1\n"), std::string::npos) << text;
}

TEST(Metrics, CountsRemotePrefillsAndTheirBytesPerHost) {
  Metrics metrics;
  metrics.count_remote_prefill("http://a:1", "ok", 1000);
  metrics.count_remote_prefill("http://a:1", "ok", 24);
  metrics.count_remote_prefill("http://b:2", "busy");
  const std::string text = metrics.render();
  EXPECT_NE(text.find("kvshare_remote_prefills_total{host=\"http://a:1\",result=\"ok\"} 2\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find("kvshare_remote_prefills_total{host=\"http://b:2\",result=\"busy\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("kvshare_remote_kv_bytes_total{host=\"http://a:1\"} 1024\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kvshare_remote_kv_bytes_total{host=\"http://b:2\"} 0\n"), std::string::npos) << text;
}

TEST(Metrics, CountsHandoffsChosenForLoad) {
  Metrics metrics;
  EXPECT_NE(metrics.render().find("kvshare_load_handoffs_total 0\n"), std::string::npos);
  metrics.count_load_handoff();
  metrics.count_load_handoff();
  const std::string text = metrics.render();
  EXPECT_NE(text.find("# TYPE kvshare_load_handoffs_total counter\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kvshare_load_handoffs_total 2\n"), std::string::npos) << text;
}

TEST(Metrics, PutsEachTimingInCumulativeBuckets) {
  Metrics metrics;
  metrics.observe("shared", 30.0, 0.4, 31.0);
  metrics.observe("shared", 3.0, 0.2, 3.5);
  const std::string text = metrics.render();
  EXPECT_NE(text.find("kvshare_handoff_ms_bucket{route=\"shared\",le=\"0.25\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kvshare_handoff_ms_bucket{route=\"shared\",le=\"0.5\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("kvshare_prefill_ms_bucket{route=\"shared\",le=\"5\"} 1\n"), std::string::npos);
  EXPECT_NE(text.find("kvshare_prefill_ms_bucket{route=\"shared\",le=\"+Inf\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("kvshare_first_byte_ms_sum{route=\"shared\"} 34.5\n"), std::string::npos);
  EXPECT_NE(text.find("kvshare_first_byte_ms_count{route=\"shared\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE kvshare_prefill_ms histogram\n"), std::string::npos);
}

}  // namespace
}  // namespace kvshare::route
