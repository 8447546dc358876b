#include "route/prefill_hosts.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

namespace kvshare::route {
namespace {

using namespace std::chrono_literals;

// A clock the test moves by hand.
struct FakeClock {
  PrefillHosts::Clock::time_point now{};
  PrefillHosts::Now function() {
    return [this] { return now; };
  }
};

PrefillHosts three_hosts(FakeClock& clock) {
  auto hosts = PrefillHosts::from_urls({"http://a:1", "http://b:2", "http://c:3"}, clock.function());
  EXPECT_TRUE(hosts) << hosts.error().what();
  return std::move(*hosts);
}

TEST(PrefillHosts, RefusesABadUrlAndAHostGivenTwice) {
  auto bad = PrefillHosts::from_urls({"http://a:1", "ftp://b:2"});
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message().find("ftp://b:2"), std::string::npos);
  auto twice = PrefillHosts::from_urls({"http://a:1", "http://a:1/"});
  ASSERT_FALSE(twice);
  EXPECT_NE(twice.error().message().find("given twice"), std::string::npos) << twice.error().message();
}

TEST(PrefillHosts, TheLeastBusyHostComesFirst) {
  FakeClock clock;
  PrefillHosts hosts = three_hosts(clock);
  EXPECT_EQ(hosts.order(0), (std::vector<size_t>{0, 1, 2}));
  PrefillHosts::Lease at_a(hosts, 0);
  PrefillHosts::Lease again_at_a(hosts, 0);
  PrefillHosts::Lease at_b(hosts, 1);
  EXPECT_EQ(hosts.order(0), (std::vector<size_t>{2, 1, 0}));
  EXPECT_EQ(hosts.in_flight(0), 2u);
}

TEST(PrefillHosts, TheSlotsHostFirstUnlessMuchBusier) {
  FakeClock clock;
  PrefillHosts hosts = three_hosts(clock);
  hosts.note_success(2, 5);
  EXPECT_EQ(hosts.order(5), (std::vector<size_t>{2, 0, 1}));
  EXPECT_EQ(hosts.order(4), (std::vector<size_t>{0, 1, 2})) << "another slot has no preference";
  {
    PrefillHosts::Lease one(hosts, 2);
    EXPECT_EQ(hosts.order(5).front(), 2u) << "one more in flight than the least busy is still preferred";
    PrefillHosts::Lease two(hosts, 2);
    EXPECT_EQ(hosts.order(5), (std::vector<size_t>{0, 1, 2}));
  }
  EXPECT_EQ(hosts.order(5).front(), 2u);
}

TEST(PrefillHosts, AFailedHostGoesLastForItsBackOffAndLosesItsSlots) {
  FakeClock clock;
  PrefillHosts hosts = three_hosts(clock);
  hosts.note_success(0, 1);
  hosts.note_failure(0);
  EXPECT_TRUE(hosts.backing_off(0));
  EXPECT_EQ(hosts.order(1), (std::vector<size_t>{1, 2, 0}));
  hosts.note_failure(1);
  hosts.note_failure(1);
  // Both down: the one whose back-off ends first comes first.
  EXPECT_EQ(hosts.order(1), (std::vector<size_t>{2, 0, 1}));
  clock.now += 1001ms;
  EXPECT_FALSE(hosts.backing_off(0));
  EXPECT_TRUE(hosts.backing_off(1));
  EXPECT_EQ(hosts.order(1), (std::vector<size_t>{0, 2, 1})) << "host 0 no longer holds slot 1's prompt";
  hosts.note_success(1, 3);
  EXPECT_FALSE(hosts.backing_off(1));
}

TEST(PrefillHosts, TheBackOffDoublesUpToThirtySeconds) {
  EXPECT_EQ(prefill_host_back_off(0), 0ms);
  EXPECT_EQ(prefill_host_back_off(1), 1000ms);
  EXPECT_EQ(prefill_host_back_off(2), 2000ms);
  EXPECT_EQ(prefill_host_back_off(5), 16000ms);
  EXPECT_EQ(prefill_host_back_off(6), 30000ms);
  EXPECT_EQ(prefill_host_back_off(100), 30000ms);
}

}  // namespace
}  // namespace kvshare::route
