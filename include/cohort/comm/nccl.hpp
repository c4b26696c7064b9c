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

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "cohort/comm/detail/device_identity.hpp"
#include "cohort/comm/detail/device_scope.hpp"
#include "cohort/comm/detail/failure_report.hpp"
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
// What every work handle of one communicator shares (comm/detail/nccl_state.hpp): only the
// engine's bodies (impl/nccl.ipp) see its definition, so that a unit compiled once does not
// instantiate its members (issue 44).
struct nccl_state;

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

    COHORT_DECL bool test() const;
    // Blocks the host until done; past the group's timeout the communicator is aborted
    // and a timeout_error thrown.
    COHORT_DECL void wait() const;
    COHORT_DECL bool wait_for(std::chrono::milliseconds timeout) const;
    // The caller's stream waits for this work; the host does not.
    COHORT_DECL void make_stream_wait(cudaStream_t caller) const;
    COHORT_DECL cudaEvent_t event() const noexcept;

   private:
    friend class nccl;  // only the engine makes a work that completes with its event
    explicit work(std::shared_ptr<detail::nccl_event> event, std::string operation)
        : event_(std::move(event)), operation_(std::move(operation)) {}
    // One check (blocking = false) or a polling loop until done or deadline (blocking).
    COHORT_DECL bool poll(std::chrono::steady_clock::time_point deadline, bool blocking) const;
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

  COHORT_DECL int rank() const noexcept;
  COHORT_DECL int size() const noexcept;
  COHORT_DECL int device() const noexcept;
  COHORT_DECL cudaStream_t stream() const noexcept;
  COHORT_DECL ncclComm_t communicator() const noexcept;
  const options& settings() const noexcept { return options_; }
  // How its messages name its ranks: a subgroup's by world rank, with the group.
  COHORT_DECL detail::rank_naming names() const;
  COHORT_DECL const flight_recorder& recorder() const noexcept;
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
  work issue(const char* operation, call_record recorded, Call&& call);
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
