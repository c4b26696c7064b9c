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
// kernels algorithms need are in detail/device_elementwise.cuh, which cohort/ops.hpp
// includes when nvcc compiles the translation unit.

#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "cohort/detail/device_identity.hpp"
#include "cohort/error.hpp"
#include "cohort/launch.hpp"
#include "cohort/store.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0 {

namespace detail {

// Views, not strings: the calls made for every collective pass literals, and a std::string
// parameter would build (past 15 characters, allocate) one per call just to drop it.
inline void check_cuda(cudaError_t status, int rank, std::string_view operation, std::string_view hint = {}) {
  if (status == cudaSuccess) [[likely]]
    return;
  throw error(rank, "cuda." + std::string(operation),
              std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status),
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

// What every work handle of one communicator shares: the communicator, its stream, the
// event pool, and whether the communicator has been aborted.
struct nccl_state {
  int rank = 0;
  int size = 1;
  int device = 0;
  std::chrono::milliseconds timeout{};
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  std::mutex mutex;  // guards events and aborted
  std::vector<cudaEvent_t> free_events;
  bool aborted = false;
  std::string abort_reason;

  ~nccl_state() {
    // No checks here: a destructor must not throw, and after an abort the context may be gone.
    cudaSetDevice(device);
    for (auto event : free_events) cudaEventDestroy(event);
    if (comm) {
      if (!aborted) {
        ncclCommFinalize(comm);
        ncclResult_t pending = ncclInProgress;
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (pending == ncclInProgress && std::chrono::steady_clock::now() < deadline)
          ncclCommGetAsyncError(comm, &pending);
        if (pending == ncclSuccess)
          ncclCommDestroy(comm);
        else
          ncclCommAbort(comm);
      } else {
        ncclCommAbort(comm);
      }
    }
    if (stream) cudaStreamDestroy(stream);
  }

  cudaEvent_t take_event() {
    {
      std::lock_guard lock(mutex);
      if (!free_events.empty()) {
        cudaEvent_t event = free_events.back();
        free_events.pop_back();
        return event;
      }
    }
    cudaEvent_t event;
    check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), rank, "event_create");
    return event;
  }
  void give_event(cudaEvent_t event) {
    std::lock_guard lock(mutex);
    free_events.push_back(event);
  }

  [[noreturn]] void fail(const std::string& operation, ncclResult_t status, const std::string& hint) {
    const char* last = comm ? ncclGetLastError(comm) : nullptr;
    std::string detail = ncclGetErrorString(status);
    if (last && *last) detail += ": " + std::string(last);
    abort(operation + " failed: " + detail);
    throw error(rank, "nccl." + operation, detail, hint);
  }

  void abort(const std::string& reason) {
    std::lock_guard lock(mutex);
    if (aborted || !comm) return;
    aborted = true;
    abort_reason = reason;
    ncclCommAbort(comm);
    comm = nullptr;
  }

  void check_usable(const std::string& operation) {
    std::lock_guard lock(mutex);
    if (aborted)
      throw error(rank, "nccl." + operation, "the communicator was aborted earlier (" + abort_reason + ")",
                  "an earlier collective failed or timed out; recreate the process group");
  }

  // Non-blocking communicators may answer ncclInProgress; wait until the call is enqueued.
  void settle(const std::string& operation, ncclResult_t status) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (status == ncclInProgress) {
      if (std::chrono::steady_clock::now() > deadline) {
        abort(operation + " timed out while being enqueued");
        throw timeout_error(rank, "nccl." + operation, "not enqueued within " + format_duration(timeout),
                            "a peer has not joined; check that every rank issues the same collectives");
      }
      std::this_thread::yield();
      ncclCommGetAsyncError(comm, &status);
    }
    if (status != ncclSuccess)
      fail(operation, status, "sizes or dtypes may differ across ranks, or a peer died (NCCL_DEBUG=WARN tells more)");
  }
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
  };

  class work {
   public:
    work() = default;
    explicit work(std::shared_ptr<detail::nccl_event> event, std::string operation)
        : event_(std::move(event)), operation_(std::move(operation)) {}

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
        detail::check_cuda(status, event_->state->rank, "stream_wait_event(" + operation_ + ")");
    }
    cudaEvent_t event() const noexcept { return event_ ? event_->event : nullptr; }

   private:
    // One check (blocking = false) or a polling loop until done or deadline (blocking).
    bool poll(std::chrono::steady_clock::time_point deadline, bool blocking) const {
      auto& state = *event_->state;
      for (int round = 0;; ++round) {
        const cudaError_t status = cudaEventQuery(event_->event);
        if (status == cudaSuccess) return true;
        if (status != cudaErrorNotReady) detail::check_cuda(status, state.rank, "event_query(" + operation_ + ")");
        {
          std::unique_lock lock(state.mutex);
          if (state.aborted)
            throw error(state.rank, "nccl." + operation_, "communicator aborted: " + state.abort_reason,
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
          state.abort(operation_ + " exceeded the timeout");
          throw timeout_error(state.rank, "nccl." + operation_,
                              "not complete after " + detail::format_duration(state.timeout) + "; communicator aborted",
                              "a peer never entered this collective: it hangs, crashed, or issued "
                              "collectives in another order (COHORT_DEBUG=1 compares calls)");
        }
        if (round > 1000) std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }

    std::shared_ptr<detail::nccl_event> event_;
    std::string operation_;
  };

  nccl(std::shared_ptr<cohort::store> store, const launch_env& env, const options& opts)
      : state_(std::make_shared<detail::nccl_state>()) {
    state_->rank = env.rank;
    state_->size = env.world_size;
    state_->timeout = opts.timeout;
    options_ = opts;
    select_device(*store, env, opts);
    ncclUniqueId id;
    if (env.rank == 0) {
      check_nccl(ncclGetUniqueId(&id), "get_unique_id");
      store->set("nccl_unique_id",
                 std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(&id), sizeof id));
    } else {
      const bytes value = store->get("nccl_unique_id");
      if (value.size() != sizeof id)
        throw error(env.rank, "nccl.init",
                    "unique id of " + std::to_string(value.size()) + " bytes, expected " + std::to_string(sizeof id),
                    "ranks built against different NCCL versions, or the store key was overwritten");
      std::memcpy(&id, value.data(), sizeof id);
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = nullptr;
    ncclResult_t status = ncclCommInitRankConfig(&comm, env.world_size, id, env.rank, &config);
    state_->comm = comm;
    finish_init("comm_init_rank(world " + std::to_string(env.world_size) + ")", status);
    create_stream_and_scratch();
  }

  // Subgroup: ncclCommSplit; every rank of the parent calls it, excluded ones with a
  // negative color (no communicator, nullptr returned).
  static std::unique_ptr<nccl> split(nccl& parent, std::shared_ptr<cohort::store> /*sub_store*/, int color, int key,
                                     int new_rank, int new_size) {
    parent.state_->check_usable("split");
    detail::check_cuda(cudaSetDevice(parent.state_->device), parent.state_->rank, "set_device");
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = nullptr;
    ncclResult_t status =
        ncclCommSplit(parent.state_->comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &comm, &config);
    parent.state_->settle("comm_split", status);
    if (color < 0 || comm == nullptr) return nullptr;
    auto child = std::unique_ptr<nccl>(new nccl());
    child->options_ = parent.options_;
    auto& state = *child->state_;
    state.rank = new_rank;
    state.size = new_size;
    state.timeout = parent.state_->timeout;
    state.device = parent.state_->device;
    state.comm = comm;
    child->finish_init("comm_split(color " + std::to_string(color) + ")", ncclInProgress);
    child->create_stream_and_scratch();
    return child;
  }

  nccl(const nccl&) = delete;
  nccl& operator=(const nccl&) = delete;
  ~nccl() {
    if (barrier_scratch_) {
      cudaSetDevice(state_->device);
      cudaFree(barrier_scratch_);
    }
  }

  int rank() const noexcept { return state_->rank; }
  int size() const noexcept { return state_->size; }
  int device() const noexcept { return state_->device; }
  cudaStream_t stream() const noexcept { return state_->stream; }
  ncclComm_t communicator() const noexcept { return state_->comm; }
  const options& settings() const noexcept { return options_; }

  work all_reduce(const void* in, void* out, std::size_t count, dtype type, op reduce) {
    return issue("all_reduce", [&] {
      return ncclAllReduce(in, out, count, detail::nccl_type(type), detail::nccl_op(reduce), state_->comm,
                           state_->stream);
    });
  }
  work reduce_scatter(const void* in, void* out, std::size_t count_per_rank, dtype type, op reduce) {
    return issue("reduce_scatter", [&] {
      return ncclReduceScatter(in, out, count_per_rank, detail::nccl_type(type), detail::nccl_op(reduce), state_->comm,
                               state_->stream);
    });
  }
  work all_gather(const void* in, void* out, std::size_t count_per_rank, dtype type) {
    return issue("all_gather", [&] {
      return ncclAllGather(in, out, count_per_rank, detail::nccl_type(type), state_->comm, state_->stream);
    });
  }
  work broadcast(void* data, std::size_t count, dtype type, int root) {
    return issue("broadcast", [&] {
      return ncclBroadcast(data, data, count, detail::nccl_type(type), root, state_->comm, state_->stream);
    });
  }
  work all_to_all(const void* in, void* out, std::size_t count_per_rank, dtype type) {
    return issue("all_to_all", [&] {
      const std::size_t bytes = count_per_rank * size_of(type);
      ncclResult_t status = ncclGroupStart();
      for (int peer = 0; peer < size() && status == ncclSuccess; ++peer) {
        status = ncclSend(static_cast<const char*>(in) + bytes * static_cast<std::size_t>(peer), count_per_rank,
                          detail::nccl_type(type), peer, state_->comm, state_->stream);
        if (status == ncclSuccess)
          status = ncclRecv(static_cast<char*>(out) + bytes * static_cast<std::size_t>(peer), count_per_rank,
                            detail::nccl_type(type), peer, state_->comm, state_->stream);
      }
      const ncclResult_t ended = ncclGroupEnd();
      return status != ncclSuccess ? status : ended;
    });
  }
  // NCCL has no tags: point-to-point messages between two ranks match in issue order.
  work send(const void* data, std::size_t count, dtype type, int peer, std::uint64_t /*tag*/) {
    return issue("send",
                 [&] { return ncclSend(data, count, detail::nccl_type(type), peer, state_->comm, state_->stream); });
  }
  work recv(void* data, std::size_t count, dtype type, int peer, std::uint64_t /*tag*/) {
    return issue("recv",
                 [&] { return ncclRecv(data, count, detail::nccl_type(type), peer, state_->comm, state_->stream); });
  }
  // NCCL has no barrier: a one-element all-reduce every rank must join.
  work barrier() {
    return issue("barrier", [&] {
      return ncclAllReduce(barrier_scratch_, barrier_scratch_, 1, ncclInt32, ncclSum, state_->comm, state_->stream);
    });
  }

  // --- ordering and memory --------------------------------------------------------------
  work record() { return record_event("record"); }
  // Later work on the communication stream waits for what the caller queued on `caller`.
  void wait_for_caller(cudaStream_t caller) {
    const auto event = std::make_shared<detail::nccl_event>(state_, state_->take_event());
    detail::check_cuda(cudaEventRecord(event->event, caller), rank(), "event_record(caller)");
    detail::check_cuda(cudaStreamWaitEvent(state_->stream, event->event, 0), rank(), "stream_wait_event(caller)");
  }
  void* allocate(std::size_t bytes) {
    void* pointer = nullptr;
    detail::check_cuda(cudaSetDevice(state_->device), rank(), "set_device");
    detail::check_cuda(cudaMalloc(&pointer, bytes == 0 ? 1 : bytes), rank(),
                       "malloc(" + std::to_string(bytes) + " bytes)",
                       "the GPU is out of memory: lower the bucket size or shard the model");
    return pointer;
  }
  void deallocate(void* pointer, std::size_t /*bytes*/) noexcept {
    cudaSetDevice(state_->device);
    cudaFree(pointer);
  }
  work copy(void* destination, const void* source, std::size_t bytes) {
    detail::check_cuda(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDefault, state_->stream), rank(),
                       "memcpy_async(" + std::to_string(bytes) + " bytes)");
    return record_event("copy");
  }

 private:
  nccl() : state_(std::make_shared<detail::nccl_state>()) {}

  void check_nccl(ncclResult_t status, const std::string& operation) {
    if (status != ncclSuccess && status != ncclInProgress)
      throw error(rank(), "nccl." + operation, ncclGetErrorString(status),
                  "check the NCCL installation (NCCL_DEBUG=INFO)");
  }

  void select_device(cohort::store& store, const launch_env& env, const options& opts) {
    int count = 0;
    detail::check_cuda(cudaGetDeviceCount(&count), env.rank, "get_device_count");
    const int device = opts.device >= 0 ? opts.device : env.local_rank;
    if (device >= count) {
      const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
      throw error(env.rank, "nccl.select_device",
                  "device " + std::to_string(device) + " (local rank " + std::to_string(env.local_rank) +
                      ") but only " + std::to_string(count) + " GPU(s) visible" +
                      (visible ? std::string(" (CUDA_VISIBLE_DEVICES=") + visible + ")" : std::string()),
                  "launch at most as many ranks per node as GPUs (--nproc-per-node), or fix CUDA_VISIBLE_DEVICES");
    }
    state_->device = device;
    detail::check_cuda(cudaSetDevice(device), env.rank, "set_device(" + std::to_string(device) + ")");
    char bus[64] = {};
    detail::check_cuda(cudaDeviceGetPCIBusId(bus, sizeof bus, device), env.rank, "device_get_pci_bus_id");
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    const std::string identity = std::string(host) + "|" + bus;
    store.set("device/" + std::to_string(env.rank), identity);
    std::vector<std::string> identities;
    for (int r = 0; r < env.world_size; ++r) identities.push_back(store.get_string("device/" + std::to_string(r)));
    if (const auto duplicate = detail::find_duplicate_device(identities))
      throw error(env.rank, "nccl.select_device", detail::describe_duplicate(*duplicate),
                  detail::duplicate_device_hint());
  }

  void finish_init(const std::string& operation, ncclResult_t status) {
    const auto deadline = std::chrono::steady_clock::now() + state_->timeout;
    while (status == ncclInProgress) {
      if (std::chrono::steady_clock::now() > deadline) {
        state_->abort(operation + " timed out");
        throw timeout_error(rank(), "nccl." + operation, "not done after " + detail::format_duration(state_->timeout),
                            "a rank never arrived: check that every rank started with the same WORLD_SIZE");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      ncclCommGetAsyncError(state_->comm, &status);
    }
    if (status != ncclSuccess) state_->fail(operation, status, "check NCCL_DEBUG=WARN output on every rank");
  }

  void create_stream_and_scratch() {
    int least = 0, greatest = 0;
    detail::check_cuda(cudaDeviceGetStreamPriorityRange(&least, &greatest), rank(), "stream_priority_range");
    // Communication gets the highest priority so it is not starved by compute kernels.
    detail::check_cuda(cudaStreamCreateWithPriority(&state_->stream, cudaStreamNonBlocking, greatest), rank(),
                       "stream_create");
    barrier_scratch_ = allocate(sizeof(int));
    detail::check_cuda(cudaMemset(barrier_scratch_, 0, sizeof(int)), rank(), "memset");
  }

  template <class Call>
  work issue(const char* operation, Call&& call) {
    state_->check_usable(operation);
    // settle() only when NCCL did not answer ncclSuccess: it reads the clock for its deadline.
    if (const ncclResult_t status = call(); status != ncclSuccess) state_->settle(operation, status);
    return record_event(operation);
  }

  work record_event(const char* operation) {
    auto event = std::make_shared<detail::nccl_event>(state_, state_->take_event());
    if (const cudaError_t status = cudaEventRecord(event->event, state_->stream); status != cudaSuccess)
      detail::check_cuda(status, rank(), std::string("event_record(") + operation + ")");
    return work(std::move(event), operation);
  }

  std::shared_ptr<detail::nccl_state> state_;
  options options_;
  void* barrier_scratch_ = nullptr;
};

}  // namespace cohort::inline v0
