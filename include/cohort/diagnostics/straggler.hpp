#pragma once
// straggler_report: which rank holds the others up, and how much of each step is exposed
// communication.
//
//   cohort::straggler_report stragglers{pg, {.every = 100}};
//   cohort::training_state<cohort::gloo> state{pg, regions, {.straggler = &stragglers}};
//   for (...) { backward(...); state.step(); }   // step() ends each step
//   stragglers.flush();                          // the last, partial window
//
// every 100 steps rank 0 prints one line (stderr by default), here 3 Gloo ranks, rank 2 30 ms slower:
//
//   cohort straggler report, steps 11-20, 3 ranks: step 49.1 ms; compute min 5.8 (rank 1),
//   median 6.0, max 36.7 (rank 2) ms; waiting in step/gathers min 12.4 (rank 2), median 43.1,
//   max 43.3 (rank 1) ms; exposed communication 25%..88% of the step (median 88%); slowest:
//   rank 2, +30.7 ms/step of compute over the median
//
// What is measured, per rank and step, on the host's steady clock only:
//   step     from one step boundary to the next. training_state::step() is the boundary
//            when the state has the report (no_sync micro-steps belong to the step they
//            accumulate for); without one, call end_step() once per optimizer step.
//   wait     time the calling thread was blocked waiting for communication: inside the
//            training_state's step(), in its zero3 gather() (its wait for the layer's
//            all-gathers), and in report.wait(work) / add_wait() for any other wait.
//   compute  step - wait: everything else (forward, backward, optimizer, data loading).
//   exposed  wait / step: the share of the step spent waiting for communication.
// A slow rank computes longer; the others wait for it in their next blocking collective, so
// the rank with the largest compute time (and the smallest wait) is the one named slowest.
//
// On a device backend (NCCL) step() and a gather's wait() make the caller's stream wait and
// return at once: the waits measured there are the host's time in those calls (queueing
// work, and check_nonfinite's one blocking read), not the time the GPU's stream stood still,
// so compute reads as the whole step. The report says so in its line (host_clock_only).
//
// Step 1 ends at the first boundary and is not measured: it includes construction, the
// first allocations and whatever ran before the loop. Windows are aligned to multiples of
// `every`: steps 2..every, then every+1..2*every, and so on.
//
// The exchange goes through the group's store, not a collective: at the last step of a
// window each rank sets one key (one store round trip); rank 0 keeps its own numbers and
// collects the others' without blocking: at each later step boundary it checks once whether
// all have arrived (one round trip), then reads and deletes them (2 round trips per rank).
// A rank that has not reported within the timeout is named missing in that window's report;
// no step ever waits for the exchange (only flush(), at the end, waits on rank 0, at most the
// timeout), nothing throws for a missing rank and nothing is issued on the group's engine, so
// the report cannot add a hang or reorder collectives. If the store itself fails
// the report prints one line saying why on that rank and stops (the training's own next
// collective names the cause better than a store error would).
//
// Cost when attached: two clock reads per step() and per gather wait, an atomic add per
// wait; nothing else between window ends. Detached (the default) or every = 0: one pointer
// test. Not thread-safe except add_wait() and wait(), which gather guards on other threads
// may call; the report must outlive the training state it is given to.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cohort/config.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0 {

class store;
class timeline;

// What a wait was for: where the report's caller was blocked.
enum class wait_kind : std::uint8_t { reduce, gather, other };

// One rank's numbers for one window, as means per step in milliseconds.
struct straggler_rank_stats {
  int rank = -1;
  std::uint64_t steps = 0;    // steps measured in the window
  double step_ms = 0;         // mean step time
  double reduce_wait_ms = 0;  // blocked in training_state::step()
  double gather_wait_ms = 0;  // blocked in training_state's zero3 gathers
  double other_wait_ms = 0;   // report.wait(work) and add_wait(wait_kind::other, ...)
  double max_step_ms = 0;     // the window's longest step
  // straggler_options::cpu_time_compute: the training thread's CPU time a step outside the
  // state's waits, its compute without the time other threads took from it (0: not measured).
  double compute_cpu_ms = 0;

  double wait_ms() const noexcept { return reduce_wait_ms + gather_wait_ms + other_wait_ms; }
  // Waits on another thread (a gather guard) may overlap the step's own: clamped at 0.
  double compute_ms() const noexcept { return step_ms > wait_ms() ? step_ms - wait_ms() : 0.0; }
  // wait / step of the window's means, in [0, 1].
  double exposed() const noexcept {
    if (step_ms <= 0) return 0.0;
    return wait_ms() >= step_ms ? 1.0 : wait_ms() / step_ms;
  }
};

// The lowest, median and highest of one quantity over the ranks that reported, and which
// ranks hold the extremes (the lowest rank on ties). An even count's median is the mean of
// the two middle values.
struct straggler_spread {
  double min = 0;
  double median = 0;
  double max = 0;
  int min_rank = -1;
  int max_rank = -1;
};

// A slowest rank computing at most this fraction over the median counts as balanced.
inline constexpr double straggler_balance_tolerance = 0.05;

// One window over every rank: what rank 0 reports.
struct straggler_summary {
  std::uint64_t first_step = 0;
  std::uint64_t last_step = 0;
  int world = 0;
  std::vector<straggler_rank_stats> ranks;  // the ranks that reported, in rank order
  std::vector<int> missing;                 // ranks with no report within the timeout
  std::chrono::milliseconds timeout{0};     // how long rank 0 waited for the missing ones
  straggler_spread step;                    // ms per step
  straggler_spread compute;                 // ms per step
  straggler_spread compute_cpu;             // ms per step of CPU time (0: not measured)
  straggler_spread wait;                    // ms per step
  straggler_spread exposed;                 // fraction of the step
  int slowest = -1;                         // the largest compute time; -1 when none reported
  double slowest_over_median_ms = 0;        // its compute minus the median compute
  bool balanced = true;                     // slowest within straggler_balance_tolerance of the median
  bool host_clock_only = false;             // device backend: waits are host time (see the top)

  // The stats of `rank`, or nullptr when it did not report.
  COHORT_COLD const straggler_rank_stats* find(int rank) const noexcept;
};

// Pure: the spreads, the slowest rank and its margin, from the ranks' stats (any order).
COHORT_COLD straggler_summary summarize_stragglers(std::uint64_t first_step, std::uint64_t last_step, int world,
                                                   std::vector<straggler_rank_stats> ranks,
                                                   std::vector<int> missing = {});

// The one line rank 0 prints (no newline).
COHORT_COLD [[gnu::cold]] std::string format_straggler_report(const straggler_summary& summary);

// A run that says when it slows: rank 0 compares each window with a baseline of the first
// windows and writes ONE line when, for `sustained` windows in a row, either one rank computes
// longer than the median rank by `threshold` of the baseline step more than it did in the
// baseline, and that explains at least half of the step's rise (it names that rank), or every
// rank's step moved past `every_rank_threshold` of the baseline step, or the exposed share
// past `exposed_threshold`, alike (it names no rank: the network, the input pipeline, a shared
// cause; higher than a rank's threshold, since a host shared with other work moves every
// rank's step by a third and more on its own). The same finding is not repeated until it has cleared for a window; a
// window with missing ranks is neither baseline nor evidence.
struct slowdown_options {
  std::uint64_t baseline_windows = 3;  // the first complete windows after step 1
  std::uint64_t sustained = 2;         // windows in a row past the threshold before the line
  double threshold = 0.3;              // of the baseline step (see above)
  double every_rank_threshold = 0.75;  // every rank's step alike: of the baseline step
  double exposed_threshold = 0.25;     // a rise of the median exposed share, in [0, 1]
  double min_ms = 2.0;                 // a change smaller than this (ms per step) is noise
};

// What a slowdown watch found in one window.
struct slowdown_finding {
  int rank = -1;                 // the rank that slowed alone; -1: every rank alike
  std::uint64_t first_step = 0;  // the first window past the threshold
  std::uint64_t last_step = 0;   // the window that made it sustained
  std::string line;              // what rank 0 writes (no newline)
};

// Pure: fed rank 0's window summaries in order, returns a finding at most once per cause.
class slowdown_watch {
 public:
  explicit slowdown_watch(slowdown_options options = {}) : options_(options) {}
  COHORT_COLD std::optional<slowdown_finding> observe(const straggler_summary& window);
  bool has_baseline() const noexcept { return baseline_count_ >= options_.baseline_windows; }

 private:
  slowdown_options options_;
  std::uint64_t baseline_count_ = 0;
  double baseline_step_ms_ = 0;  // the least of the baseline windows' median steps (a busy host only adds)
  double baseline_exposed_ = 0;  // and of their median exposed shares
  double baseline_lead_ms_ = 0;  // and of the slowest rank's lead over the median compute
  int candidate_ = -2;           // the cause being watched: a rank, -1 all alike, -2 none
  std::uint64_t candidate_windows_ = 0;
  std::uint64_t candidate_first_ = 0;
  int reported_ = -2;  // the cause last reported, until it clears
};

// The scaling verdict: rank 0's block at the end of a run (straggler_report::run_summary()):
// step time, the exposed communication share, the slowest rank and by how much, and what N
// ranks deliver against one. One rank's step is estimated as the N ranks' median compute
// times N (the whole global batch computed on one rank, with no communication to wait for);
// the N-rank throughput against it is that estimate over the measured N-rank step. It
// assumes compute scales with the batch and leaves out the optimizer's share, which one rank
// pays too (it is in step()'s time: counted as waiting here). From CPU time, ranks that share
// a core (more ranks than cores) read high: each one preempted mid-compute refills its caches
// (+5% at 4 rank threads on 2 cores, docs/benchmarks.md).
struct scaling_verdict {
  int world = 0;
  double step_ms = 0;           // the median rank's mean step
  double exposed = 0;           // the median exposed share
  double one_rank_step_ms = 0;  // the estimate of one rank's step on the whole batch
  bool from_cpu_time = false;   // estimated from the compute's CPU time (cpu_time_compute)
  double speedup = 0;           // one_rank_step_ms / step_ms: N ranks' throughput over one's
  int slowest = -1;
  double slowest_over_median_ms = 0;
  std::string advice;  // what to try, when communication is exposed
};
COHORT_COLD scaling_verdict scaling_verdict_of(const straggler_summary& run);
COHORT_COLD [[gnu::cold]] std::string format_scaling_verdict(const scaling_verdict& verdict);

struct straggler_options {
  // Steps per window; 0 turns the report off (no clock is read, nothing is exchanged).
  std::uint64_t every = 100;
  // Where rank 0 prints each window's line; nullptr: nowhere. Other ranks never print a
  // report (only a line if their store fails).
  std::FILE* output = stderr;
  // Called on rank 0 with each window's summary, after printing (on the training thread,
  // inside the step() or end_step() that collected it; exceptions propagate from there).
  std::function<void(const straggler_summary&)> on_report = {};
  // How long rank 0 waits for a window's reports before naming the missing ranks;
  // 0: the store's own timeout (a group's store: the group's timeout).
  std::chrono::milliseconds timeout{0};
  // Rank 0 watches for a slowdown (slowdown_watch) and writes its one line to
  // `slowdown_output` (stderr by default; nullptr: nowhere); the timeline, when given, keeps
  // the steps of that window beyond its ring.
  std::optional<slowdown_options> slowdown = {};
  std::FILE* slowdown_output = stderr;
  timeline* slowdown_timeline = nullptr;
  // Called on rank 0 with each finding, after writing its line.
  std::function<void(const slowdown_finding&)> on_slowdown = {};
  // The verdict estimates one rank's step from each rank's CPU time outside the state's waits
  // (on the training thread) rather than its wall time: right where ranks share cores (ranks
  // as threads on a small host), whose contention inflates every rank's wall-clock compute;
  // wrong where the compute runs on other threads or a device (ignored on a device backend).
  // Costs a CPU-clock read at each step boundary and two around each of the state's waits.
  bool cpu_time_compute = false;
};

class straggler_report {
 public:
  using clock = std::chrono::steady_clock;

  // Every rank of `group` (a process_group, or anything with group_store(), rank() and
  // size()) constructs its report in the same order: the n-th report of a rank exchanges
  // with the n-th of every other rank.
  template <class Group>
  explicit straggler_report(Group& group, straggler_options options = {})
      : straggler_report(group.group_store(), static_cast<int>(group.rank()), static_cast<int>(group.world_size()),
                         std::move(options)) {
    if constexpr (requires { Group::space; }) host_clock_only_ = Group::space == memory_space::device;
  }
  // Over any store shared by `world` ranks.
  COHORT_COLD straggler_report(std::shared_ptr<store> exchange, int rank, int world, straggler_options options = {});

  straggler_report(const straggler_report&) = delete;
  straggler_report& operator=(const straggler_report&) = delete;
  ~straggler_report() = default;

  // Configured on (every > 0). Stays true after a store failure stopped the exchange.
  bool enabled() const noexcept { return every_ > 0; }
  int rank() const noexcept { return rank_; }
  int world() const noexcept { return world_; }
  const straggler_options& options() const noexcept { return options_; }
  // Step boundaries seen so far (the step that ends at boundary k is step k).
  std::uint64_t steps() const noexcept { return boundaries_; }

  // The calling thread was blocked `waited` waiting for communication. Any thread.
  void add_wait(wait_kind kind, clock::duration waited) noexcept {
    if (!enabled()) return;
    waits_[static_cast<std::size_t>(kind)].fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(waited).count(), std::memory_order_relaxed);
  }
  // cpu_time_compute: the training thread's CPU clock (ns), which the state reads around its
  // waits, and the CPU time it spent in them (the training thread only).
  bool times_cpu() const noexcept { return enabled() && options_.cpu_time_compute && !host_clock_only_; }
  COHORT_COLD static std::int64_t thread_cpu_ns() noexcept;
  void add_wait_cpu(std::int64_t ns) noexcept { wait_cpu_ns_ += ns; }
  // Waits for `done` (any work handle: done.wait()) and counts the time as a wait.
  template <class Work>
  void wait(const Work& done, wait_kind kind = wait_kind::other) {
    if (!enabled()) {
      done.wait();
      return;
    }
    const auto start = clock::now();
    done.wait();
    add_wait(kind, clock::now() - start);
  }

  // A step ends (training_state::step() calls this when it has the report). At the last
  // step of a window the rank publishes its numbers; rank 0 collects whatever has arrived.
  void end_step() {
    if (enabled()) end_step(clock::now());
  }
  void end_step(clock::time_point now) { (this->*step_boundary_)(now); }

  // At the end of training, on every rank: publishes the steps since the last window, then
  // rank 0 waits (each window at most the timeout after it was published) for every window
  // still pending and reports it, naming ranks that never reported. Other ranks return at once.
  COHORT_COLD void flush();

  // Rank 0: every window reported so far as one (the means over their steps, per rank);
  // empty before the first report and on other ranks. What the scaling verdict reads.
  COHORT_COLD std::optional<straggler_summary> run_summary() const;
  // Rank 0: the latest window's summary (empty before the first, and on other ranks).
  const std::optional<straggler_summary>& latest() const noexcept { return latest_; }
  // This rank's own numbers for its latest published window.
  const straggler_rank_stats& last_window() const noexcept { return last_window_; }
  // Non-empty when the store failed and the report stopped.
  const std::string& failure() const noexcept { return failure_; }

 private:
  struct pending_window {
    std::uint64_t index = 0;
    std::uint64_t first_step = 0;
    std::uint64_t last_step = 0;
    clock::time_point deadline{};
    straggler_rank_stats own;
  };

  COHORT_COLD void step_boundary(clock::time_point now);
  COHORT_COLD void publish(clock::time_point now);
  COHORT_COLD void collect(bool blocking);
  COHORT_COLD void report(const pending_window& window, std::vector<straggler_rank_stats> ranks,
                          std::vector<int> missing);
  COHORT_COLD void stop(const std::string& what);
  COHORT_COLD std::string key(std::uint64_t window, int rank) const;
  COHORT_COLD std::chrono::milliseconds exchange_timeout() const;

  // &straggler_report::step_boundary, set by the constructor. end_step reaches the window's
  // work (publishing, rank 0's collecting and report) through it, so that header-only a
  // translation unit that only ends steps (gradient_reducer::finish) compiles none of that
  // work: the one that constructs the report does.
  void (straggler_report::*step_boundary_)(clock::time_point) = nullptr;
  std::shared_ptr<store> store_;
  int rank_ = 0;
  int world_ = 1;
  straggler_options options_;
  std::uint64_t every_ = 0;
  bool host_clock_only_ = false;
  std::int64_t id_ = 0;  // this report's number among this rank's reports on the store

  std::uint64_t boundaries_ = 0;
  std::uint64_t published_ = 0;  // windows published, the partial ones of flush() included
  clock::time_point last_boundary_{};
  std::uint64_t window_first_step_ = 0;
  std::uint64_t window_steps_ = 0;
  std::int64_t window_step_ns_ = 0;
  std::int64_t window_max_step_ns_ = 0;
  std::atomic<std::int64_t> waits_[3] = {};  // ns, by wait_kind, since the window began
  // cpu_time_compute: the training thread's CPU clock at the last boundary, its CPU time in
  // the window's steps and in the state's waits (ns).
  std::int64_t last_boundary_cpu_ns_ = 0;
  std::int64_t window_step_cpu_ns_ = 0;
  std::int64_t wait_cpu_ns_ = 0;

  std::vector<pending_window> pending_;  // rank 0: windows still collecting, oldest first
  std::optional<straggler_summary> latest_;
  std::optional<slowdown_watch> slowdown_;        // rank 0, when options_.slowdown
  std::vector<straggler_rank_stats> run_totals_;  // rank 0: sums over the windows (ms x steps)
  std::uint64_t run_first_step_ = 0;
  straggler_rank_stats last_window_;
  std::string failure_;
  bool stopped_ = false;
};

}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/diagnostics/impl/straggler.ipp"
#endif
