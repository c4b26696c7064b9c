#pragma once
// The NCCL engine's shared state (cohort/comm/nccl.hpp): what every work handle of one
// communicator shares. Only the engine's bodies (comm/impl/nccl.ipp) include it, header-only
// or compiled once by src.hpp: a unit compiled once that includes nccl.hpp sees these types by
// name only and does not instantiate their members (issue 44).

#include <cuda_runtime.h>
#include <nccl.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cohort/comm/detail/failure_report.hpp"
#include "cohort/comm/detail/fifo_queue.hpp"
#include "cohort/comm/flight_recorder.hpp"
#include "cohort/config.hpp"
#include "cohort/detail/progress.hpp"
#include "cohort/rendezvous/store.hpp"

namespace cohort::inline v0::detail {

struct nccl_event;

// What every work handle of one communicator shares: the communicator, its stream, the
// event pool, whether the communicator has been aborted, and what the watchdog watches.
struct nccl_state {
  int rank = 0;
  // What errors call this rank: its world rank (a subgroup's board knows it), else `rank`.
  int reported_rank() const { return board ? board->names().world_rank(rank) : rank; }
  int size = 1;
  int device = 0;
  std::chrono::milliseconds timeout{};
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  // Guards events, aborted and comm: abort() takes the communicator under it and aborts it
  // outside, so every other reader of comm snapshots it (or polls it) under this lock.
  std::mutex mutex;
  std::vector<cudaEvent_t> free_events;
  bool aborted = false;
  std::string abort_reason;

  COHORT_DECL ~nccl_state();

  COHORT_DECL cudaEvent_t take_event();
  COHORT_DECL void give_event(cudaEvent_t event);

  [[gnu::cold]] [[noreturn]] COHORT_DECL void fail(const std::string& operation, ncclResult_t status,
                                                   const std::string& hint);

  // Publishes the failure (aborted, abort_reason) and takes the communicator under the lock,
  // then aborts it outside every lock on a thread of its own (comm/detail/background_abort.hpp),
  // waiting for that at most `wait_at_most`: a negative wait means min(timeout, 10 s). The
  // watchdog waits not at all, so its policy acts (or the process ends) even when the
  // abort hangs behind a kernel that never ends.
  COHORT_DECL void abort(const std::string& reason,
                         std::chrono::milliseconds wait_at_most = std::chrono::milliseconds(-1));

  COHORT_DECL void check_usable(const std::string& operation);

  // Non-blocking communicators may answer ncclInProgress; wait until the call is enqueued.
  COHORT_DECL void settle(const std::string& operation, ncclResult_t status);

  // --- failure reporting (cohort/comm/detail/failure_report.hpp) ----------------------------
  // A call on the stream that the watchdog polls until its event completes. The stream runs
  // calls in issue order, so only the oldest can be overdue first.
  struct outstanding_call {
    call_record call;
    std::uint64_t record = 0;
    std::chrono::steady_clock::time_point issued;
    std::shared_ptr<nccl_event> done;
  };
  std::unique_ptr<flight_recorder> recorder;
  std::shared_ptr<cohort::store> store;       // the group's namespace, for failure reports
  std::unique_ptr<status_board> board;        // every rank's status in that namespace
  std::unique_ptr<progress_monitor> monitor;  // on the watchdog's thread
  std::string group;
  std::string trace_dir;
  bool watched = false;  // a watchdog polls `outstanding` (else nothing is queued there)
  std::atomic<bool> trace_written{false};
  std::mutex watch_mutex;  // guards the members below; never taken while holding `mutex`
  detail::fifo_queue<outstanding_call> outstanding;
  std::uint64_t collectives_issued = 0;
  std::uint64_t collectives_completed = 0;
  std::array<std::uint64_t, call_kinds> issued_by_kind{};
  std::map<std::pair<int, bool>, std::uint64_t> p2p_issued;  // (peer, sending): NCCL has no tags

  // Numbers the call, records it and, when watched, queues it for the watchdog.
  COHORT_DECL void issued(call_record call, const std::shared_ptr<nccl_event>& done);
  // The watchdog's check: completes finished calls in the recorder; runs the progress
  // monitor on the oldest call not complete (ranks in different calls abort the
  // communicator); past the timeout (or on an asynchronous NCCL error) aborts the
  // communicator and returns the error naming the rank at fault. Nothing once the group was
  // aborted by a call that reported it.
  COHORT_DECL std::exception_ptr watch();
  // This rank's status for the status board.
  COHORT_DECL rank_status status(rank_activity activity);
  // "rank 2 never issued all_reduce #7 (...); ranks 0, 1 are waiting in it" for the oldest
  // call not complete (or `operation` when none is known), asking the other ranks.
  [[gnu::cold]] COHORT_DECL std::string name_the_culprit(const std::string& operation);
  [[gnu::cold]] COHORT_DECL void keep_trace(std::string_view failure);
};

// A pooled event that returns to its pool when the last work handle holding it goes.
struct nccl_event {
  std::shared_ptr<nccl_state> state;
  cudaEvent_t event;
  nccl_event(std::shared_ptr<nccl_state> owner, cudaEvent_t e) : state(std::move(owner)), event(e) {}
  nccl_event(const nccl_event&) = delete;
  nccl_event& operator=(const nccl_event&) = delete;
  ~nccl_event() { state->give_event(event); }
};

}  // namespace cohort::inline v0::detail

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/comm/impl/nccl.ipp"
#endif
