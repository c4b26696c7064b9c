#pragma once
// Device backend on NCCL: collectives on GPU memory, ordered on the group's own CUDA stream.
//
// Work handles are CUDA events recorded after each call; a caller's stream can wait on one
// without blocking the host (work::make_stream_wait), and the communication stream can be
// made to wait for the caller's stream (wait_for_caller) so gradients are reduced only once
// produced. The communicator is non-blocking: initialisation and every wait poll NCCL's
// asynchronous error and a deadline, and a wait that exceeds the group's timeout aborts the
// communicator (ncclCommAbort) and throws, so a dead or missing peer never hangs a rank.
// This header has no device code and compiles with any C++20 compiler; the element-wise
// kernels algorithms need are in comm/detail/device_elementwise.cuh, which cohort/comm/ops.hpp
// includes when nvcc compiles the translation unit.

#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "cohort/comm/detail/device_identity.hpp"
#include "cohort/comm/detail/device_scope.hpp"
#include "cohort/comm/detail/failure_report.hpp"
#include "cohort/comm/detail/fifo_queue.hpp"
#include "cohort/config.hpp"
#include "cohort/detail/progress.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/rendezvous/launch.hpp"
#include "cohort/rendezvous/store.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0 {

namespace detail {

// Views, not strings: the calls made for every collective pass literals, and a std::string
// parameter would build (past 15 characters, allocate) one per call just to drop it.
inline void check_cuda(cudaError_t status, int rank, std::string_view operation, std::string_view hint = {}) {
  if (status == cudaSuccess) [[likely]]
    return;
  throw error(rank, detail::text("cuda.", operation),
              detail::text(cudaGetErrorName(status), ": ", cudaGetErrorString(status)),
              hint.empty() ? "check the device index and that the driver sees a GPU (nvidia-smi)" : std::string(hint));
}

#define COHORT_NCCL_TYPE(name, host, text, floating, nccl, cuda) \
  case dtype::name: return nccl;
inline ncclDataType_t nccl_type(dtype type) {
  switch (type) { COHORT_DTYPES(COHORT_NCCL_TYPE) }
  return ncclFloat32;
}
#undef COHORT_NCCL_TYPE

inline ncclRedOp_t nccl_op(op reduce) {
  switch (reduce) {
    case op::sum: return ncclSum;
    case op::avg: return ncclAvg;
    case op::product: return ncclProd;
    case op::min: return ncclMin;
    case op::max: return ncclMax;
  }
  return ncclSum;
}

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

}  // namespace detail

class nccl {
 public:
  static constexpr memory_space space = memory_space::device;
  static constexpr std::string_view name = "nccl";
  using stream_type = cudaStream_t;

  struct options {
    // Bounds initialisation and every wait; past it the communicator is aborted.
    std::chrono::milliseconds timeout{std::chrono::minutes(10)};
    bool debug_checks = false;  // also COHORT_DEBUG=1
    // GPU to drive; -1 picks local_rank (one rank per GPU, as NCCL requires).
    int device = -1;
    // The flight recorder's ring (0: off); trace files go to `trace_dir` or COHORT_TRACE_DIR.
    std::size_t flight_recorder_entries = 2048;
    std::string trace_dir;
    // How often the watchdog polls the stream's outstanding calls and NCCL's asynchronous
    // error; 0: no watchdog (then a kernel stuck behind which the caller's stream waits is
    // bounded only by waits made through cohort). Past `timeout` it aborts the communicator.
    std::chrono::milliseconds watchdog_interval{100};
    async_error_handling on_async_error = async_error_handling::abort_process;
    // As gloo::options: a call not complete after this long compares what every rank is
    // doing, and ranks found in different calls (or one that left or failed) abort the
    // communicator within seconds, naming each rank's call; 0: never. Needs the watchdog.
    std::chrono::milliseconds compare_calls_after{std::chrono::seconds(3)};
    // Progress lines of a waiting call; 0: never. Default: COHORT_PROGRESS_INTERVAL, else 30 s.
    std::chrono::milliseconds progress_interval = detail::default_progress_interval();
  };

  class work {
   public:
    work() = default;

    bool test() const {
      if (!event_) return true;
      return poll(std::chrono::steady_clock::time_point::max(), false);
    }
    // Blocks the host until done; past the group's timeout the communicator is aborted
    // and a timeout_error thrown.
    void wait() const {
      if (!event_) return;
      poll(std::chrono::steady_clock::now() + event_->state->timeout, true);
    }
    bool wait_for(std::chrono::milliseconds timeout) const {
      if (!event_) return true;
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      while (!poll(deadline, false)) {
        if (std::chrono::steady_clock::now() >= deadline) return false;
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      return true;
    }
    // The caller's stream waits for this work; the host does not.
    void make_stream_wait(cudaStream_t caller) const {
      if (!event_) return;
      if (const cudaError_t status = cudaStreamWaitEvent(caller, event_->event, 0); status != cudaSuccess)
        detail::check_cuda(status, event_->state->rank, detail::text("stream_wait_event(", operation_, ")"));
    }
    cudaEvent_t event() const noexcept { return event_ ? event_->event : nullptr; }

   private:
    friend class nccl;  // only the engine makes a work that completes with its event
    explicit work(std::shared_ptr<detail::nccl_event> event, std::string operation)
        : event_(std::move(event)), operation_(std::move(operation)) {}
    // One check (blocking = false) or a polling loop until done or deadline (blocking).
    bool poll(std::chrono::steady_clock::time_point deadline, bool blocking) const {
      auto& state = *event_->state;
      for (int round = 0;; ++round) {
        const cudaError_t status = cudaEventQuery(event_->event);
        if (status == cudaSuccess) return true;
        if (status != cudaErrorNotReady)
          detail::check_cuda(status, state.rank, detail::text("event_query(", operation_, ")"));
        {
          std::unique_lock lock(state.mutex);
          if (state.aborted)
            throw error(state.rank, detail::text("nccl.", operation_),
                        detail::text("communicator aborted: ", state.abort_reason),
                        "an earlier failure or timeout ended this group");
          ncclResult_t async = ncclSuccess;
          ncclCommGetAsyncError(state.comm, &async);
          if (async != ncclSuccess && async != ncclInProgress) {
            lock.unlock();
            state.fail(operation_, async, "a peer failed or the network broke (NCCL_DEBUG=WARN tells more)");
          }
        }
        if (!blocking) return false;
        if (std::chrono::steady_clock::now() > deadline) {
          state.abort(detail::text(operation_, " exceeded the timeout"));
          const std::string culprit = state.name_the_culprit(operation_);
          state.keep_trace(culprit);
          throw timeout_error(state.rank, detail::text("nccl.", operation_),
                              detail::text(culprit, ": not complete after ", detail::format_duration(state.timeout),
                                           "; communicator aborted"),
                              "a peer never entered this collective: it hangs, crashed, or issued "
                              "collectives in another order (COHORT_DEBUG=1 compares calls)");
        }
        if (round > 1000) std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }

    friend class nccl;
    std::shared_ptr<detail::nccl_event> event_;
    std::string operation_;
  };

  COHORT_DECL nccl(std::shared_ptr<cohort::store> store, const launch_env& env, const options& opts);

  // Subgroup: ncclCommSplit; every rank of the parent calls it, excluded ones with a
  // negative color (no communicator, nullptr returned). `members`: the parent's rank of each
  // of its ranks, in order (its size).
  COHORT_DECL static std::unique_ptr<nccl> split(nccl& parent, std::shared_ptr<cohort::store> /*sub_store*/, int color,
                                                 int key, int new_rank, const std::vector<int>& members);

  nccl(const nccl&) = delete;
  nccl& operator=(const nccl&) = delete;
  COHORT_DECL ~nccl();

  int rank() const noexcept { return state_->rank; }
  int size() const noexcept { return state_->size; }
  int device() const noexcept { return state_->device; }
  cudaStream_t stream() const noexcept { return state_->stream; }
  ncclComm_t communicator() const noexcept { return state_->comm; }
  const options& settings() const noexcept { return options_; }
  // How its messages name its ranks: a subgroup's by world rank, with the group.
  detail::rank_naming names() const { return state_->board ? state_->board->names() : detail::rank_naming{}; }
  const flight_recorder& recorder() const noexcept { return *state_->recorder; }
  // The context recorded with each call issued from now on (process_group::call_context).
  const call_label& call_context() const noexcept { return call_context_; }
  void set_call_context(const call_label& label) noexcept { call_context_ = label; }
  [[gnu::cold]] COHORT_DECL std::string write_trace(const std::string& directory, std::string_view reason) const;

  COHORT_DECL work all_reduce(const void* in, void* out, std::size_t count, dtype type, op reduce);
  COHORT_DECL work reduce_scatter(const void* in, void* out, std::size_t count_per_rank, dtype type, op reduce);
  COHORT_DECL work all_gather(const void* in, void* out, std::size_t count_per_rank, dtype type);
  COHORT_DECL work broadcast(void* data, std::size_t count, dtype type, int root);
  COHORT_DECL work all_to_all(const void* in, void* out, std::size_t count_per_rank, dtype type);
  // NCCL has no tags: point-to-point messages between two ranks match in issue order.
  COHORT_DECL work send(const void* data, std::size_t count, dtype type, int peer, std::uint64_t /*tag*/);
  COHORT_DECL work recv(void* data, std::size_t count, dtype type, int peer, std::uint64_t /*tag*/);
  // NCCL has no barrier: a one-element all-reduce every rank must join.
  COHORT_DECL work barrier();

  // Grouped calls (process_group::grouped): between group_start and the matching group_end
  // NCCL only collects the calls (ncclGroupStart/End), and launches them together at the
  // end, as one kernel where it can. Their work handles complete from then on: waiting on
  // one before the group ends is an error of the caller's (it would wait for nothing).
  COHORT_DECL void group_start();
  COHORT_DECL void group_end();

  // --- ordering and memory --------------------------------------------------------------
  work record() { return record_event("record"); }
  // Later work on the communication stream waits for what the caller queued on `caller`.
  COHORT_DECL void wait_for_caller(cudaStream_t caller);
  COHORT_DECL void* allocate(std::size_t bytes);
  COHORT_DECL void deallocate(void* pointer, std::size_t /*bytes*/) noexcept;
  COHORT_DECL work copy(void* destination, const void* source, std::size_t bytes);

 private:
  // Compiled with the engine: its make_shared would be instantiated in every unit that includes this.
  COHORT_DECL nccl();

  COHORT_DECL void check_nccl(ncclResult_t status, const std::string& operation);

  COHORT_DECL void select_device(cohort::store& store, const launch_env& env, const options& opts);

  COHORT_DECL void finish_init(const std::string& operation, ncclResult_t status);

  COHORT_DECL void create_stream_and_scratch();
  // The recorder, the group's name and the watchdog (after the communicator exists).
  // `world`: the world rank of each group rank (a subgroup's; empty for the world), which its
  // messages name the ranks by.
  COHORT_DECL void start_failure_reporting(std::shared_ptr<cohort::store> group_store, std::vector<int> world = {});

  template <class Call>
  work issue(const char* operation, call_record recorded, Call&& call) {
    recorded.context = call_context_;
    if (watchdog_) watchdog_->rethrow_if_failed();
    const detail::device_scope on_device(state_->device);
    state_->check_usable(operation);
    // settle() only when NCCL did not answer ncclSuccess: it reads the clock for its deadline.
    if (const ncclResult_t status = call(); status != ncclSuccess) state_->settle(operation, status);
    if (group_depth_ > 0) return deferred(operation, recorded);
    work done = record_event(operation);
    state_->issued(recorded, done.event_);
    return done;
  }
  // Inside a group: an event recorded at group_end, once NCCL has launched the calls.
  COHORT_DECL work deferred(const char* operation, const call_record& recorded);

  COHORT_DECL work record_event(const char* operation);

  std::shared_ptr<detail::nccl_state> state_;
  options options_;
  void* barrier_scratch_ = nullptr;
  int group_depth_ = 0;
  struct grouped_call {
    call_record call;
    std::shared_ptr<detail::nccl_event> done;
  };
  std::vector<grouped_call> grouped_;  // issued inside the open group, recorded at its end
  call_label call_context_;            // the caller's thread only
  std::unique_ptr<detail::watchdog> watchdog_;
};

}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/comm/impl/nccl.ipp"
#endif
