#include "route/prefill_hosts.h"

#include <algorithm>
#include <utility>

namespace kvshare::route {

std::chrono::milliseconds prefill_host_back_off(unsigned failures_in_a_row) {
  constexpr std::chrono::milliseconds kFirst{1000};
  constexpr std::chrono::milliseconds kMost{30000};
  if (failures_in_a_row == 0) return std::chrono::milliseconds(0);
  const unsigned doublings = std::min(failures_in_a_row - 1, 5u);
  return std::min(kFirst * (1u << doublings), kMost);
}

Result<PrefillHosts> PrefillHosts::from_urls(const std::vector<std::string>& urls, Now now) {
  std::vector<Host> hosts;
  for (const std::string& url : urls) {
    auto address = parse_prefill_remote_url(url);
    if (!address) return fail(address.error());
    for (const Host& seen : hosts)
      if (seen.address.host == address->host && seen.address.port == address->port)
        return fail(EINVAL, "--prefill-remote {} is given twice (as {}): give each prefill host once", url, seen.url);
    Host host;
    host.url = url;
    host.address = *address;
    hosts.push_back(std::move(host));
  }
  return PrefillHosts(std::move(hosts), std::move(now));
}

PrefillHosts::PrefillHosts(std::vector<Host> hosts, Now now) : hosts_(std::move(hosts)), now_(std::move(now)) {}

PrefillHosts::PrefillHosts(PrefillHosts&& other) noexcept
    : hosts_(std::move(other.hosts_)), slot_host_(std::move(other.slot_host_)), now_(std::move(other.now_)) {}

std::vector<size_t> PrefillHosts::order(int slot) const {
  std::lock_guard lock(mutex_);
  const Clock::time_point now = now_();
  std::vector<size_t> up;
  std::vector<size_t> down;
  for (size_t i = 0; i < hosts_.size(); ++i) (hosts_[i].back_off_until > now ? down : up).push_back(i);
  std::stable_sort(up.begin(), up.end(), [&](size_t a, size_t b) { return hosts_[a].in_flight < hosts_[b].in_flight; });
  std::stable_sort(down.begin(), down.end(),
                   [&](size_t a, size_t b) { return hosts_[a].back_off_until < hosts_[b].back_off_until; });
  // The host that holds this slot's conversation goes first unless it is much busier.
  if (auto held = slot_host_.find(slot); held != slot_host_.end() && !up.empty()) {
    auto at = std::find(up.begin(), up.end(), held->second);
    if (at != up.end() && hosts_[*at].in_flight <= hosts_[up.front()].in_flight + 1)
      std::rotate(up.begin(), at, at + 1);
  }
  up.insert(up.end(), down.begin(), down.end());
  return up;
}

PrefillHosts::Lease::Lease(PrefillHosts& hosts, size_t host) : hosts_(hosts), host_(host) {
  std::lock_guard lock(hosts_.mutex_);
  ++hosts_.hosts_[host_].in_flight;
}

PrefillHosts::Lease::~Lease() {
  std::lock_guard lock(hosts_.mutex_);
  --hosts_.hosts_[host_].in_flight;
}

void PrefillHosts::note_success(size_t host, int slot) {
  std::lock_guard lock(mutex_);
  hosts_[host].failures_in_a_row = 0;
  hosts_[host].back_off_until = {};
  slot_host_[slot] = host;
}

void PrefillHosts::note_failure(size_t host) {
  std::lock_guard lock(mutex_);
  Host& failed = hosts_[host];
  ++failed.failures_in_a_row;
  failed.back_off_until = now_() + prefill_host_back_off(failed.failures_in_a_row);
  std::erase_if(slot_host_, [&](const auto& entry) { return entry.second == host; });
}

bool PrefillHosts::backing_off(size_t host) const {
  std::lock_guard lock(mutex_);
  return hosts_[host].back_off_until > now_();
}

size_t PrefillHosts::in_flight(size_t host) const {
  std::lock_guard lock(mutex_);
  return hosts_[host].in_flight;
}

}  // namespace kvshare::route
