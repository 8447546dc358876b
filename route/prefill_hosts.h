// The prefill hosts serve may send a remote handoff to (--prefill-remote, once per host):
// the order to ask them in for one request, and what each has done. No scheduler beyond
// that (docs/remote.md, "Several prefill hosts"): a router in front of several serves
// (Dynamo's KV router, llm-d) does the rest.
//
// The order for a request: the host that prefilled the slot's previous prompt first, when
// it is up and no busier than the least busy host plus one (it keeps that conversation's
// KV: only the new suffix needs computing there); then the others, fewest requests in
// flight first; hosts that failed lately last, in the order their back-off ends. A host
// that failed stays last for a back-off (1 s, doubling per failure in a row up to 30 s);
// one success clears it. Thread-safe.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "layout/error.h"
#include "route/serve_config.h"

namespace kvshare::route {

class PrefillHosts {
 public:
  using Clock = std::chrono::steady_clock;
  using Now = std::function<Clock::time_point()>;

  // Parses every URL (EINVAL naming the bad one). `now` is the clock (tests give their own).
  static Result<PrefillHosts> from_urls(const std::vector<std::string>& urls, Now now = Clock::now);

  PrefillHosts(PrefillHosts&& other) noexcept;
  PrefillHosts& operator=(PrefillHosts&&) = delete;

  size_t size() const { return hosts_.size(); }
  const std::string& url(size_t host) const { return hosts_[host].url; }
  const RemoteProviderUrl& address(size_t host) const { return hosts_[host].address; }

  // The hosts to try for a request into `slot`, best first (every host, once).
  std::vector<size_t> order(int slot) const;

  // A request is at `host` while the lease lives.
  class Lease {
   public:
    Lease(PrefillHosts& hosts, size_t host);
    ~Lease();
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;

   private:
    PrefillHosts& hosts_;
    size_t host_;
  };

  // `host` prefilled `slot`'s prompt: the slot's next turn prefers it.
  void note_success(size_t host, int slot);
  // `host` did not prefill (no answer, busy, an error): it goes last for its back-off, and
  // no slot prefers it any more.
  void note_failure(size_t host);
  // Whether `host` is inside a back-off now.
  bool backing_off(size_t host) const;
  size_t in_flight(size_t host) const;

 private:
  struct Host {
    std::string url;
    RemoteProviderUrl address;
    size_t in_flight = 0;
    unsigned failures_in_a_row = 0;
    Clock::time_point back_off_until{};
  };
  PrefillHosts(std::vector<Host> hosts, Now now);

  mutable std::mutex mutex_;
  std::vector<Host> hosts_;
  std::map<int, size_t> slot_host_;  // the host that prefilled each slot's latest prompt
  Now now_;
};

// How long a host that failed `failures_in_a_row` times stays last: 1 s, doubling, at most 30 s.
std::chrono::milliseconds prefill_host_back_off(unsigned failures_in_a_row);

}  // namespace kvshare::route
