#pragma once
// What every backend needs to say who is at fault when a call fails:
//
// - the flight recorder itself (cohort/comm/flight_recorder.hpp);
// - write_trace: on a failure, the ring goes to COHORT_TRACE_DIR/rank<R>.<group>.json,
//   which `cohort-trace DIR` reads across ranks.
// - name_the_culprit: after a failure each rank publishes the call it is in to the group's
//   store and reads what the others published, for a short, bounded while, so the error
//   names the rank at fault ("rank 2 never issued all_reduce #7 (float x 8, sum); ranks 0,
//   1 are waiting in it") instead of an address or a key.
// - watchdog: a thread per group that enforces the group's timeout on work nobody waits
//   for through cohort, and acts on failures nobody observes (see async_error_handling).

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "cohort/comm/flight_recorder.hpp"
#include "cohort/config.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0 {

class store;

namespace detail {

// "all_reduce #7 (float x 8, sum)", "broadcast #2 (int32 x 4, root 1)", "send #1 (float x 3,
// peer 2, tag 5)", "barrier #9": how errors, reports and trace analysis name a call.
COHORT_DECL std::string describe(const call_record& call);

// Who wrote a trace file.
struct trace_identity {
  std::string group;  // "pg1", "pg1.split0.color1": see group_name
  std::string_view backend;
  int rank = 0;
  int world = 1;
};

// The group's name in trace files and reports, from its store's prefix ("cohort/pg1/" -> "pg1").
COHORT_DECL std::string group_name(const store& group_store);

// `configured`, else COHORT_TRACE_DIR, else empty (no trace files).
COHORT_DECL std::string trace_directory(const std::string& configured);

// Writes DIR/rank<R>.<group>.json (format: docs/design.md, "Flight recorder"); returns its
// path, or an empty string when it could not be written. Never throws: it runs while an
// error is on its way.
[[gnu::cold]] COHORT_DECL std::string write_trace(const std::string& directory, const trace_identity& who,
                                                  const flight_recorder& recorder, std::string_view failure);

// What a backend can tell of a peer that sent no failure report, without its help.
enum class peer_state : std::uint8_t {
  unknown,      // no way to tell (a backend without probes)
  alive,        // connected (or its process runs, on this host): it never issued the call
  died,         // its connection closed, or its process (on this host) is gone
  unreachable,  // no connection to it and its host does not answer
};
struct peer_status {
  peer_state state = peer_state::unknown;
  std::string why;  // "its connection closed", "no answer from 10.0.0.3 within 1 s", ...
};
// `thorough`: may take a while (at most a second or the timeout) to tell alive from
// unreachable; otherwise answers at once, with `unknown` where only waiting could tell.
using peer_probe = std::function<peer_status(int peer, bool thorough)>;

// After `call` (this rank's collective number `sequence`) failed: publishes it under
// failure/<rank> in the group's store, reads the other ranks' reports for at most
// min(timeout, 5 s) through a handle bounded by that window, and says who is at fault. A
// rank that sent no report is named as `probe` finds it: died, unreachable, or (alive) never
// issued the call. Without a probe, `connection_lost` (the engine reported a closed connection
// rather than a timeout) names the silent ranks dead, else as never having issued the call.
[[gnu::cold]] COHORT_DECL std::string name_the_culprit(store& group_store, int rank, int size,
                                                       std::chrono::milliseconds timeout, const std::string& call,
                                                       bool connection_lost, const peer_probe& probe = {});

// A thread that calls check() every `interval` until it returns a failure (or the watchdog
// is destroyed), then hands the failure to the policy: abort_process ends the process,
// throw_on_next_call keeps it for rethrow_if_failed(). check() runs on the watchdog's thread.
class watchdog {
 public:
  using check_fn = std::function<std::exception_ptr()>;

  COHORT_DECL watchdog(int rank, std::string group, async_error_handling policy, std::chrono::milliseconds interval,
                       check_fn check);
  watchdog(const watchdog&) = delete;
  watchdog& operator=(const watchdog&) = delete;
  COHORT_DECL ~watchdog();

  // Throws the failure the watchdog found, if any (throw_on_next_call): every call of the
  // group starts with it, so a broken group is reported at the next call, not later.
  void rethrow_if_failed() const {
    if (!found_.load(std::memory_order_acquire)) [[likely]]
      return;
    std::lock_guard lock(mutex_);
    if (failure_) std::rethrow_exception(failure_);
  }

 private:
  COHORT_DECL void loop();
  COHORT_DECL void act(std::exception_ptr failure);

  int rank_;
  std::string group_;
  async_error_handling policy_;
  std::chrono::milliseconds interval_;
  check_fn check_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::atomic<bool> found_{false};
  std::exception_ptr failure_;
  std::thread thread_;  // last: starts once everything above exists
};

}  // namespace detail
}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/comm/impl/failure_report.ipp"
#endif
