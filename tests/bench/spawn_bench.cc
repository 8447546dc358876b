// kvshare-bench spawn: what starting a child costs the process that starts it. The spawner
// (kvshare/share/spawn.h, glibc's posix_spawn) and fork + execve are timed in pairs from a
// parent holding a touched region (0 or 1 GiB, as serve holds its model and buffers),
// alternating which goes first, with the death-signal path (setpriv and a shell) beside
// them; each spawns /bin/true and reaps it. Also counted: the parent's minor faults per
// spawn, and how many of the region's pages fault once more when the parent writes them
// after one spawn (fork write-protects them all for copy-on-write).
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <string>
#include <vector>

#include "bench_registry.h"
#include "bench_stats.h"
#include "kvshare/share/spawn.h"

namespace kvshare::bench {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kPage = 4096;

long minor_faults() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

// An anonymous region with every 4 KiB page written once (no huge pages: one fault per page).
class TouchedRegion {
 public:
  explicit TouchedRegion(size_t bytes) : bytes_(std::max(bytes, kPage)) {
    memory_ = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (memory_ == MAP_FAILED) {
      memory_ = nullptr;
      return;
    }
    ::madvise(memory_, bytes_, MADV_NOHUGEPAGE);
    write_every_page();
  }
  ~TouchedRegion() {
    if (memory_) ::munmap(memory_, bytes_);
  }
  TouchedRegion(const TouchedRegion&) = delete;
  TouchedRegion& operator=(const TouchedRegion&) = delete;
  bool ok() const { return memory_ != nullptr; }
  // The minor faults that writing every page again takes.
  long write_every_page() {
    const long before = minor_faults();
    auto* bytes = static_cast<volatile char*>(memory_);
    for (size_t i = 0; i < bytes_; i += kPage) bytes[i] = static_cast<char>(bytes[i] + 1);
    return minor_faults() - before;
  }

 private:
  size_t bytes_;
  void* memory_ = nullptr;
};

// Seconds to spawn /bin/true through the spawner and reap it; -1 when it did not exit 0.
double time_spawner(bool die_with_parent) {
  const auto start = Clock::now();
  auto child = ChildProcess::spawn({"/bin/true"}, SpawnOptions{.die_with_parent = die_with_parent});
  if (!child) return -1;
  auto finished = child->wait_for(std::chrono::seconds(60));
  if (!finished || !finished->status.ok()) return -1;
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double time_fork_exec() {
  const auto start = Clock::now();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::execl("/bin/true", "true", nullptr);
    ::_exit(127);
  }
  if (pid < 0) return -1;
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return -1;
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void bm_spawn(benchmark::State& state) {
  TouchedRegion region(static_cast<size_t>(state.range(0)) << 20);
  if (!region.ok()) return state.SkipWithError("mmap of the parent's region failed");
  // The copy-on-write cost, once each: the pages that fault again after one spawn.
  if (time_spawner(false) < 0) return state.SkipWithError("spawning /bin/true failed");
  const long spawn_refaults = region.write_every_page();
  if (time_fork_exec() < 0) return state.SkipWithError("fork + exec of /bin/true failed");
  const long fork_refaults = region.write_every_page();

  std::vector<double> spawn_us, die_us, fork_us, ratio, spawn_faults;
  int turn = 0;
  for (auto _ : state) {
    double t_spawn = 0, t_die = 0, t_fork = 0;
    for (int step = 0; step < 3; ++step) {
      switch ((turn + step) % 3) {
        case 0: {
          const long before = minor_faults();
          t_spawn = time_spawner(false);
          spawn_faults.push_back(static_cast<double>(minor_faults() - before));
          break;
        }
        case 1:
          t_die = time_spawner(true);
          break;
        default:
          t_fork = time_fork_exec();
          // What fork write-protected is written back here (untimed), so every fork starts
          // from the same state and no spawn pays for the fork before it.
          region.write_every_page();
      }
    }
    if (t_spawn < 0 || t_die < 0 || t_fork < 0) return state.SkipWithError("a child did not exit 0");
    turn = (turn + 1) % 3;
    state.SetIterationTime(t_spawn);
    spawn_us.push_back(t_spawn * 1e6);
    die_us.push_back(t_die * 1e6);
    fork_us.push_back(t_fork * 1e6);
    ratio.push_back(t_fork / t_spawn);
  }
  record_spread(state, "spawn_us", spawn_us);
  record_spread(state, "die_with_parent_us", die_us);
  record_spread(state, "fork_exec_us", fork_us);
  record_spread(state, "fork_over_spawn", ratio);
  state.counters["spawn_minflt"] = median(spawn_faults);
  state.counters["spawn_refaults"] = static_cast<double>(spawn_refaults);
  state.counters["fork_refaults"] = static_cast<double>(fork_refaults);
}

double counter(const RunResult& run, const std::string& key) {
  const auto found = run.counters.find(key);
  return found == run.counters.end() ? 0.0 : found->second;
}

const bool registered = add_group({
    "spawn",
    "the spawner (posix_spawn) against fork + exec from a parent holding 0 or 1 GiB, and the death-signal path",
    [](const BenchArgs& args) {
      auto* bench = benchmark::RegisterBenchmark("spawn/parent_mib", bm_spawn)->UseManualTime();
      if (args.smoke)
        bench->Arg(16)->Iterations(1);
      else
        bench->Arg(0)->Arg(1024)->Iterations(100);
    },
    [](const std::vector<RunResult>& runs, const BenchArgs& args) {
      for (const RunResult* run : runs_with_prefix(runs, "spawn/parent_mib/")) {
        // "spawn/parent_mib/1024/iterations:100/manual_time"
        const std::string after = run->name.substr(std::string("spawn/parent_mib/").size());
        const std::string mib = after.substr(0, after.find('/'));
        if (args.json) {
          fmt::print(
              "{{\"bench\":\"spawn\",\"parent_mib\":{},\"spawn_us\":{:.1f},\"die_with_parent_us\":{:.1f},"
              "\"fork_exec_us\":{:.1f},\"fork_over_spawn\":{:.3f},\"fork_over_spawn_p25\":{:.3f},"
              "\"fork_over_spawn_p75\":{:.3f},\"spawn_minflt\":{:.0f},\"spawn_refaults\":{:.0f},"
              "\"fork_refaults\":{:.0f}}}\n",
              mib, counter(*run, "spawn_us"), counter(*run, "die_with_parent_us"), counter(*run, "fork_exec_us"),
              counter(*run, "fork_over_spawn"), counter(*run, "fork_over_spawn_p25"),
              counter(*run, "fork_over_spawn_p75"), counter(*run, "spawn_minflt"), counter(*run, "spawn_refaults"),
              counter(*run, "fork_refaults"));
          continue;
        }
        fmt::print(
            "spawn, parent holding {} MiB: spawner {:.0f} us (p25 {:.0f}, p75 {:.0f}), with die_with_parent {:.0f} "
            "us, fork + exec {:.0f} us; fork / spawner {:.2f} (p25 {:.2f}, p75 {:.2f})\n"
            "  parent minor faults per spawn {:.0f}; pages faulting again when written after one spawn: spawner "
            "{:.0f}, fork {:.0f}\n",
            mib, counter(*run, "spawn_us"), counter(*run, "spawn_us_p25"), counter(*run, "spawn_us_p75"),
            counter(*run, "die_with_parent_us"), counter(*run, "fork_exec_us"), counter(*run, "fork_over_spawn"),
            counter(*run, "fork_over_spawn_p25"), counter(*run, "fork_over_spawn_p75"), counter(*run, "spawn_minflt"),
            counter(*run, "spawn_refaults"), counter(*run, "fork_refaults"));
      }
      return 0;
    },
});

}  // namespace
}  // namespace kvshare::bench
