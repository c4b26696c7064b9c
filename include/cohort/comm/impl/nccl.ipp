#pragma once
// cohort/comm/nccl.hpp's definitions: inline there when header-only, compiled once by <cohort/src.hpp>
// under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>
#include "cohort/comm/detail/background_abort.hpp"
#include "cohort/comm/detail/device_identity.hpp"
#include "cohort/comm/detail/device_scope.hpp"
#include "cohort/comm/detail/failure_report.hpp"
#include "cohort/comm/detail/nccl_state.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/rendezvous/launch.hpp"
#include "cohort/rendezvous/store.hpp"
#include "cohort/types.hpp"

#include "cohort/comm/nccl.hpp"
#include "cohort/config.hpp"

namespace cohort::inline v0 {

COHORT_DECL detail::nccl_state::~nccl_state() {
  // No checks here: a destructor must not throw, and after an abort the context may be gone.
  const device_scope on_device(device);
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
      ncclCommAbort(comm);  // never reached through abort(), which takes comm; kept for safety
    }
  }
  if (stream) cudaStreamDestroy(stream);
}

COHORT_DECL auto detail::nccl_state::take_event() -> cudaEvent_t {
  {
    std::lock_guard lock(mutex);
    if (!free_events.empty()) {
      cudaEvent_t event = free_events.back();
      free_events.pop_back();
      return event;
    }
  }
  const device_scope on_device(device);
  cudaEvent_t event;
  check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), rank, "event_create");
  return event;
}

COHORT_DECL auto detail::nccl_state::give_event(cudaEvent_t event) -> void {
  std::lock_guard lock(mutex);
  free_events.push_back(event);
}

COHORT_DECL auto detail::nccl_state::fail(const std::string& operation, ncclResult_t status, const std::string& hint)
    -> void {
  std::string detail = ncclGetErrorString(status);
  {
    std::lock_guard lock(mutex);  // comm is read under the lock: the watchdog may be taking it
    const char* last = comm ? ncclGetLastError(comm) : nullptr;
    if (last && *last) detail += detail::text(": ", last);
  }
  abort(detail::text(operation, " failed: ", detail));
  throw error(reported_rank(), detail::text("nccl.", operation), detail, hint);
}

COHORT_DECL auto detail::nccl_state::abort(const std::string& reason, std::chrono::milliseconds wait_at_most) -> void {
  ncclComm_t doomed = nullptr;
  {
    std::lock_guard lock(mutex);
    if (aborted || !comm) return;
    aborted = true;  // published first: every later call fails at once, whatever the abort does
    abort_reason = reason;
    doomed = std::exchange(comm, nullptr);
  }
  if (wait_at_most.count() < 0) wait_at_most = std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(10));
  const int gpu = device;
  abort_in_background(
      [doomed, gpu] {
        cudaSetDevice(gpu);  // a thread of its own: nothing to restore
        ncclCommAbort(doomed);
      },
      wait_at_most);
}

COHORT_DECL auto detail::nccl_state::check_usable(const std::string& operation) -> void {
  std::lock_guard lock(mutex);
  if (aborted)
    throw error(reported_rank(), detail::text("nccl.", operation),
                detail::text("the communicator was aborted earlier (", abort_reason, ")"),
                "an earlier collective failed or timed out; recreate the process group");
}

COHORT_DECL auto detail::nccl_state::settle(const std::string& operation, ncclResult_t status) -> void {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (status == ncclInProgress) {
    if (std::chrono::steady_clock::now() > deadline) {
      abort(detail::text(operation, " timed out while being enqueued"));
      throw timeout_error(reported_rank(), detail::text("nccl.", operation),
                          detail::text("not enqueued within ", format_duration(timeout)),
                          "a peer has not joined; check that every rank issues the same collectives");
    }
    std::this_thread::yield();
    std::lock_guard lock(mutex);  // the watchdog may abort (and free) comm meanwhile
    if (aborted)
      throw error(reported_rank(), detail::text("nccl.", operation),
                  detail::text("the communicator was aborted while this call was enqueued (", abort_reason, ")"),
                  "an earlier failure or timeout ended this group; recreate the process group");
    ncclCommGetAsyncError(comm, &status);
  }
  if (status != ncclSuccess)
    fail(operation, status, "sizes or dtypes may differ across ranks, or a peer died (NCCL_DEBUG=WARN tells more)");
}
COHORT_DECL auto detail::nccl_state::issued(call_record call, const std::shared_ptr<nccl_event>& done) -> void {
  std::lock_guard lock(watch_mutex);
  if (detail::is_point_to_point(call.kind))
    call.sequence = ++p2p_issued[{call.peer, call.kind == call_kind::send}];
  else {
    call.sequence = ++collectives_issued;
    ++issued_by_kind[static_cast<std::size_t>(call.kind)];
  }
  const auto now = std::chrono::steady_clock::now();
  const std::uint64_t record = recorder ? recorder->issued(call, now) : 0;
  if (!watched) return;
  outstanding.push_back(outstanding_call{call, record, now, done});
}

COHORT_DECL auto detail::nccl_state::watch() -> std::exception_ptr {
  {
    std::lock_guard state_lock(mutex);
    if (aborted) return nullptr;  // a cohort call aborted the group, and reported it
  }
  std::vector<outstanding_call> finished;  // released after the lock: their events return to the pool
  std::exception_ptr failure;
  std::string overdue;
  cudaSetDevice(device);  // the watchdog's own thread: events and the abort act on the group's GPU
  {
    std::lock_guard lock(watch_mutex);
    while (!outstanding.empty()) {
      outstanding_call& oldest = outstanding.front();
      const cudaError_t status = cudaEventQuery(oldest.done->event);
      if (status == cudaErrorNotReady) break;
      if (status != cudaSuccess) {
        if (recorder) recorder->failed(oldest.record);
        failure =
            std::make_exception_ptr(error(reported_rank(), detail::text("nccl.", describe(oldest.call)),
                                          detail::text(cudaGetErrorName(status), ": ", cudaGetErrorString(status)),
                                          "a kernel on the communication stream failed"));
        break;
      }
      if (recorder)
        recorder->completed(oldest.record, detail::is_point_to_point(oldest.call.kind) ? 0 : oldest.call.sequence);
      if (!detail::is_point_to_point(oldest.call.kind)) ++collectives_completed;
      finished.push_back(std::move(oldest));
      outstanding.pop_front();
    }
    if (!failure && !outstanding.empty() && std::chrono::steady_clock::now() - outstanding.front().issued > timeout) {
      overdue = describe(outstanding.front().call);
      if (recorder) recorder->failed(outstanding.front().record);
    }
  }
  if (!failure && overdue.empty() && monitor) {
    std::optional<pending_call> pending;
    {
      std::lock_guard lock(watch_mutex);
      for (const auto& call : outstanding)
        if (!is_point_to_point(call.call.kind)) {
          pending = pending_call{call.call, call.issued};
          break;
        }
    }
    std::string verdict = monitor->tick(pending, status(rank_activity::in_call));
    if (!verdict.empty()) {
      // Said first, then the communicator aborted: the other ranks read why this one stopped.
      auto failed = status(rank_activity::failed);
      failed.call = pending->call;
      failed.note = verdict;
      board->try_publish(failed);
      abort(verdict, std::chrono::milliseconds(0));
      failure = std::make_exception_ptr(error(reported_rank(), detail::text("nccl.", describe(pending->call)),
                                              detail::text(board->names().lead(), verdict), different_calls_hint));
    }
  }
  if (!overdue.empty()) {
    // No wait: the abort may hang behind the very kernel that is overdue, and the policy
    // (throw at the next call, or end the process) must act regardless.
    abort(detail::text(overdue, " exceeded the timeout (watchdog)"), std::chrono::milliseconds(0));
    failure = std::make_exception_ptr(
        timeout_error(reported_rank(), detail::text("nccl.", overdue),
                      detail::text(name_the_culprit(overdue), ": not complete after ", format_duration(timeout),
                                   "; the watchdog aborted the communicator"),
                      "a peer never entered this call: it hangs, crashed, or issued calls in another order "
                      "(COHORT_DEBUG=1 compares calls)"));
  }
  if (!failure) {
    ncclResult_t async = ncclSuccess;
    {
      std::lock_guard state_lock(mutex);
      if (comm != nullptr && !aborted) ncclCommGetAsyncError(comm, &async);
    }
    if (async != ncclSuccess && async != ncclInProgress) {
      const std::string detail = ncclGetErrorString(async);
      abort(detail::text("asynchronous error: ", detail), std::chrono::milliseconds(0));
      failure = std::make_exception_ptr(error(reported_rank(), "nccl.watchdog", detail,
                                              "a peer failed or the network broke (NCCL_DEBUG=WARN tells more)"));
    }
  }
  if (failure) {
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& known) {
      keep_trace(known.what());
    }
  }
  return failure;
}

COHORT_DECL auto detail::nccl_state::name_the_culprit(const std::string& operation) -> std::string {
  std::optional<call_record> call;
  {
    std::lock_guard lock(watch_mutex);
    if (!outstanding.empty()) call = outstanding.front().call;
  }
  if (!board || !call) return detail::text("this rank is in ", operation);
  // A subgroup's message says which group, and names its ranks by world rank.
  const std::string group_lead = board->names().lead();
  auto failed = status(rank_activity::failed);
  failed.call = *call;
  failed.note = detail::text("timed out after ", format_duration(timeout));
  // No probes: NCCL shows nothing of its peers' connections. A silent rank is unknown.
  return detail::text(group_lead, detail::name_the_culprit(*board, *call, failed, false));
}

COHORT_DECL auto detail::nccl_state::status(rank_activity activity) -> rank_status {
  rank_status now;
  now.activity = activity;
  std::lock_guard lock(watch_mutex);
  now.issued = collectives_issued;
  now.completed = collectives_completed;
  now.by_kind = issued_by_kind;
  return now;
}

COHORT_DECL auto detail::nccl_state::keep_trace(std::string_view failure) -> void {
  const std::string directory = trace_directory(trace_dir);
  if (directory.empty() || !recorder || trace_written.exchange(true)) return;
  detail::write_trace(directory, {group, "nccl", rank, size}, *recorder, failure);
}

COHORT_DECL auto nccl::rank() const noexcept -> int { return state_->rank; }
COHORT_DECL auto nccl::size() const noexcept -> int { return state_->size; }
COHORT_DECL auto nccl::device() const noexcept -> int { return state_->device; }
COHORT_DECL auto nccl::stream() const noexcept -> cudaStream_t { return state_->stream; }
COHORT_DECL auto nccl::communicator() const noexcept -> ncclComm_t { return state_->comm; }
COHORT_DECL auto nccl::names() const -> detail::rank_naming {
  return state_->board ? state_->board->names() : detail::rank_naming{};
}
COHORT_DECL auto nccl::recorder() const noexcept -> const flight_recorder& { return *state_->recorder; }

COHORT_DECL auto nccl::work::test() const -> bool {
  if (!event_) return true;
  return poll(std::chrono::steady_clock::time_point::max(), false);
}
COHORT_DECL auto nccl::work::wait() const -> void {
  if (!event_) return;
  poll(std::chrono::steady_clock::now() + event_->state->timeout, true);
}
COHORT_DECL auto nccl::work::wait_for(std::chrono::milliseconds timeout) const -> bool {
  if (!event_) return true;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!poll(deadline, false)) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return true;
}
COHORT_DECL auto nccl::work::make_stream_wait(cudaStream_t caller) const -> void {
  if (!event_) return;
  if (const cudaError_t status = cudaStreamWaitEvent(caller, event_->event, 0); status != cudaSuccess)
    detail::check_cuda(status, event_->state->rank, detail::text("stream_wait_event(", operation_, ")"));
}
COHORT_DECL auto nccl::work::event() const noexcept -> cudaEvent_t { return event_ ? event_->event : nullptr; }

COHORT_DECL auto nccl::work::poll(std::chrono::steady_clock::time_point deadline, bool blocking) const -> bool {
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

template <class Call>
auto nccl::issue(const char* operation, call_record recorded, Call&& call) -> work {
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

COHORT_DECL nccl::nccl() : state_(std::make_shared<detail::nccl_state>()) {}

// Not delegating to nccl(): a delegated-to constructor makes the object constructed, so a
// failed start-up would run ~nccl(), which reports the rank as left on a board it never joined.
COHORT_DECL nccl::nccl(std::shared_ptr<cohort::store> store, const launch_env& env, const options& opts)
    : state_(std::make_shared<detail::nccl_state>()) {
  state_->rank = env.rank;
  state_->size = env.world_size;
  state_->timeout = opts.timeout;
  options_ = opts;
  select_device(*store, env, opts);
  ncclUniqueId id;
  if (env.rank == 0) {
    check_nccl(ncclGetUniqueId(&id), "get_unique_id");
    store->set("nccl_unique_id", std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(&id), sizeof id));
  } else {
    const bytes value = store->get("nccl_unique_id");
    if (value.size() != sizeof id)
      throw detail::malformed_store_value(
          env.rank, "nccl.init", "nccl_unique_id", value,
          detail::text("rank 0's ncclUniqueId of ", std::to_string(sizeof id),
                       " bytes; a rank built against another NCCL version would differ too"));
    std::memcpy(&id, value.data(), sizeof id);
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t status = ncclCommInitRankConfig(&comm, env.world_size, id, env.rank, &config);
  state_->comm = comm;
  finish_init(detail::text("comm_init_rank(world ", std::to_string(env.world_size), ")"), status);
  create_stream_and_scratch();
  start_failure_reporting(std::move(store));
}

COHORT_DECL auto nccl::start_failure_reporting(std::shared_ptr<cohort::store> group_store, std::vector<int> world)
    -> void {
  auto& state = *state_;
  state.recorder = std::make_unique<flight_recorder>(options_.flight_recorder_entries);
  state.group = group_store ? detail::group_name(*group_store) : std::string("group");
  state.store = std::move(group_store);
  state.trace_dir = options_.trace_dir;
  if (state.store) {
    state.board = std::make_unique<detail::status_board>(state.store, state.rank, state.size, state.timeout,
                                                         detail::rank_naming{state.group, std::move(world)});
    state.board->try_publish_on_group_store(state.status(detail::rank_activity::joined));
  }
  if (options_.watchdog_interval.count() <= 0) return;
  state.watched = true;
  if (state.board && (options_.compare_calls_after.count() > 0 || options_.progress_interval.count() > 0))
    state.monitor = std::make_unique<detail::progress_monitor>(
        *state.board, state.group,
        detail::progress_monitor::settings{options_.compare_calls_after, options_.progress_interval});
  watchdog_ =
      std::make_unique<detail::watchdog>(state.reported_rank(), state.group, options_.on_async_error,
                                         options_.watchdog_interval, [state = state_] { return state->watch(); });
}

COHORT_DECL auto nccl::write_trace(const std::string& directory, std::string_view reason) const -> std::string {
  return detail::write_trace(directory, {state_->group, name, rank(), size()}, *state_->recorder, reason);
}

COHORT_DECL auto nccl::split(nccl& parent, std::shared_ptr<cohort::store> sub_store, int color, int key, int new_rank,
                             const std::vector<int>& members) -> std::unique_ptr<nccl> {
  parent.state_->check_usable("split");
  const detail::device_scope on_device(parent.state_->device);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclComm_t parent_comm = nullptr;
  {
    std::lock_guard lock(parent.state_->mutex);
    parent_comm = parent.state_->comm;
  }
  ncclResult_t status = ncclCommSplit(parent_comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &comm, &config);
  parent.state_->settle("comm_split", status);
  if (color < 0 || comm == nullptr) return nullptr;
  auto child = std::unique_ptr<nccl>(new nccl());
  child->options_ = parent.options_;
  auto& state = *child->state_;
  state.rank = new_rank;
  state.size = static_cast<int>(members.size());
  state.timeout = parent.state_->timeout;
  state.device = parent.state_->device;
  state.comm = comm;
  child->finish_init(detail::text("comm_split(color ", std::to_string(color), ")"), ncclInProgress);
  child->create_stream_and_scratch();
  // A subgroup names its ranks by world rank, as Gloo's: the parent's naming of each member.
  const auto* parent_board = parent.state_->board.get();
  std::vector<int> world;
  for (const int parent_rank : members)
    world.push_back(parent_board ? parent_board->names().world_rank(parent_rank) : parent_rank);
  child->start_failure_reporting(std::move(sub_store), std::move(world));
  return child;
}

COHORT_DECL nccl::~nccl() {
  watchdog_.reset();
  // Said before the communicator goes: a rank still waiting reads that this one left.
  if (state_->board) {
    auto left = state_->status(detail::rank_activity::left);
    if (state_->recorder) left.call = detail::newest_collective(*state_->recorder);
    left.note = std::uncaught_exceptions() > 0 ? "its process group was destroyed while an exception unwound its stack"
                                               : "its process group was destroyed";
    state_->board->try_publish_on_group_store(left);
  }
  state_->monitor.reset();
  // The watched calls hold events, whose owner is the state: let them go (a cycle otherwise).
  detail::fifo_queue<detail::nccl_state::outstanding_call> watched;
  {
    std::lock_guard lock(state_->watch_mutex);
    watched.swap(state_->outstanding);
    state_->watched = false;
  }
  watched.clear();
  if (barrier_scratch_) {
    const detail::device_scope on_device(state_->device);
    cudaFree(barrier_scratch_);
  }
}

COHORT_DECL auto nccl::all_reduce(const void* in, void* out, std::size_t count, dtype type, op reduce) -> work {
  return issue("all_reduce", {.kind = call_kind::all_reduce, .type = type, .reduce = reduce, .count = count}, [&] {
    return ncclAllReduce(in, out, count, detail::nccl_type(type), detail::nccl_op(reduce), state_->comm,
                         state_->stream);
  });
}

COHORT_DECL auto nccl::reduce_scatter(const void* in, void* out, std::size_t count_per_rank, dtype type, op reduce)
    -> work {
  return issue("reduce_scatter",
               {.kind = call_kind::reduce_scatter, .type = type, .reduce = reduce, .count = count_per_rank}, [&] {
                 return ncclReduceScatter(in, out, count_per_rank, detail::nccl_type(type), detail::nccl_op(reduce),
                                          state_->comm, state_->stream);
               });
}

COHORT_DECL auto nccl::all_gather(const void* in, void* out, std::size_t count_per_rank, dtype type) -> work {
  return issue("all_gather", {.kind = call_kind::all_gather, .type = type, .count = count_per_rank}, [&] {
    return ncclAllGather(in, out, count_per_rank, detail::nccl_type(type), state_->comm, state_->stream);
  });
}

COHORT_DECL auto nccl::broadcast(void* data, std::size_t count, dtype type, int root) -> work {
  return issue("broadcast", {.kind = call_kind::broadcast, .type = type, .peer = root, .count = count}, [&] {
    return ncclBroadcast(data, data, count, detail::nccl_type(type), root, state_->comm, state_->stream);
  });
}

COHORT_DECL auto nccl::all_to_all(const void* in, void* out, std::size_t count_per_rank, dtype type) -> work {
  return issue("all_to_all", {.kind = call_kind::all_to_all, .type = type, .count = count_per_rank}, [&] {
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

COHORT_DECL auto nccl::send(const void* data, std::size_t count, dtype type, int peer, std::uint64_t /*tag*/) -> work {
  return issue("send", {.kind = call_kind::send, .type = type, .peer = peer, .count = count},
               [&] { return ncclSend(data, count, detail::nccl_type(type), peer, state_->comm, state_->stream); });
}

COHORT_DECL auto nccl::recv(void* data, std::size_t count, dtype type, int peer, std::uint64_t /*tag*/) -> work {
  return issue("recv", {.kind = call_kind::recv, .type = type, .peer = peer, .count = count},
               [&] { return ncclRecv(data, count, detail::nccl_type(type), peer, state_->comm, state_->stream); });
}

COHORT_DECL auto nccl::barrier() -> work {
  return issue("barrier", {.kind = call_kind::barrier}, [&] {
    return ncclAllReduce(barrier_scratch_, barrier_scratch_, 1, ncclInt32, ncclSum, state_->comm, state_->stream);
  });
}

COHORT_DECL auto nccl::group_start() -> void {
  state_->check_usable("group_start");
  check_nccl(ncclGroupStart(), "group_start");
  ++group_depth_;
}

COHORT_DECL auto nccl::group_end() -> void {
  if (group_depth_ == 0)
    throw error(state_->reported_rank(), "nccl.group_end", "no group is open",
                "pair every group_start with one group_end");
  const detail::device_scope on_device(state_->device);
  --group_depth_;
  // The outermost end owns the group's calls from here, whatever settle() does: were it to
  // throw, stale calls would otherwise stay behind and be recorded at the next group's end.
  std::vector<grouped_call> calls;
  if (group_depth_ == 0) calls = std::exchange(grouped_, {});
  const ncclResult_t status = ncclGroupEnd();
  if (status != ncclSuccess) state_->settle("group_end", status);
  for (auto& call : calls) {
    if (const cudaError_t recorded = cudaEventRecord(call.done->event, state_->stream); recorded != cudaSuccess)
      detail::check_cuda(recorded, rank(), "event_record(group_end)");
    state_->issued(call.call, call.done);
  }
}

COHORT_DECL auto nccl::deferred(const char* operation, const call_record& recorded) -> work {
  auto event = std::make_shared<detail::nccl_event>(state_, state_->take_event());
  grouped_.push_back({recorded, event});
  return work(std::move(event), operation);
}

COHORT_DECL auto nccl::wait_for_caller(cudaStream_t caller) -> void {
  const detail::device_scope on_device(state_->device);
  const auto event = std::make_shared<detail::nccl_event>(state_, state_->take_event());
  detail::check_cuda(cudaEventRecord(event->event, caller), rank(), "event_record(caller)");
  detail::check_cuda(cudaStreamWaitEvent(state_->stream, event->event, 0), rank(), "stream_wait_event(caller)");
}

COHORT_DECL auto nccl::allocate(std::size_t bytes) -> void* {
  void* pointer = nullptr;
  const detail::device_scope on_device(state_->device);
  detail::check_cuda(cudaMalloc(&pointer, bytes == 0 ? 1 : bytes), rank(),
                     detail::text("malloc(", std::to_string(bytes), " bytes)"),
                     "the GPU is out of memory: lower the bucket size or shard the model");
  return pointer;
}

COHORT_DECL auto nccl::deallocate(void* pointer, std::size_t /*bytes*/) noexcept -> void {
  const detail::device_scope on_device(state_->device);
  cudaFree(pointer);
}

COHORT_DECL auto nccl::copy(void* destination, const void* source, std::size_t bytes) -> work {
  const detail::device_scope on_device(state_->device);
  detail::check_cuda(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDefault, state_->stream), rank(),
                     detail::text("memcpy_async(", std::to_string(bytes), " bytes)"));
  return record_event("copy");
}

COHORT_DECL auto nccl::check_nccl(ncclResult_t status, const std::string& operation) -> void {
  if (status != ncclSuccess && status != ncclInProgress)
    throw error(state_->reported_rank(), detail::text("nccl.", operation), ncclGetErrorString(status),
                "check the NCCL installation (NCCL_DEBUG=INFO)");
}

COHORT_DECL auto nccl::select_device(cohort::store& store, const launch_env& env, const options& opts) -> void {
  int count = 0;
  detail::check_cuda(cudaGetDeviceCount(&count), env.rank, "get_device_count");
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  const detail::device_choice choice = detail::choose_device(opts.device, env.local_rank, count, visible);
  if (!choice.error.empty()) throw error(env.rank, "nccl.select_device", choice.error, choice.hint);
  const int device = choice.device;
  state_->device = device;
  detail::check_cuda(cudaSetDevice(device), env.rank, detail::text("set_device(", std::to_string(device), ")"));
  char bus[64] = {};
  detail::check_cuda(cudaDeviceGetPCIBusId(bus, sizeof bus, device), env.rank, "device_get_pci_bus_id");
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  const std::string identity = detail::text(host, "|", bus);
  store.set(detail::text("device/", std::to_string(env.rank)), identity);
  // One batched read of every rank's identity (O(1) requests per rank on a tcp_store).
  std::vector<std::string> keys;
  for (int r = 0; r < env.world_size; ++r) keys.push_back(detail::text("device/", std::to_string(r)));
  std::vector<std::string> identities;
  for (const auto& value : store.multi_get(keys)) identities.push_back(to_string(value));
  for (std::size_t r = 0; r < identities.size(); ++r)
    if (!detail::well_formed_device_identity(identities[r]))
      throw detail::malformed_store_value(env.rank, "nccl.select_device", keys[r], identities[r],
                                          "'host|PCI bus id' (domain:bus:device.function)");
  if (const auto duplicate = detail::find_duplicate_device(identities))
    throw error(env.rank, "nccl.select_device",
                detail::text(detail::describe_duplicate(*duplicate), "; this rank's ",
                             detail::describe_device_counts(env.local_rank, env.local_world_size, count, visible)),
                detail::duplicate_device_hint());
}

COHORT_DECL auto nccl::finish_init(const std::string& operation, ncclResult_t status) -> void {
  const auto deadline = std::chrono::steady_clock::now() + state_->timeout;
  while (status == ncclInProgress) {
    if (std::chrono::steady_clock::now() > deadline) {
      state_->abort(detail::text(operation, " timed out"));
      throw timeout_error(state_->reported_rank(), detail::text("nccl.", operation),
                          detail::text("not done after ", detail::format_duration(state_->timeout)),
                          "a rank never arrived: check that every rank started with the same WORLD_SIZE");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    std::lock_guard lock(state_->mutex);  // the watchdog may abort (and free) comm meanwhile
    if (state_->aborted)
      throw error(state_->reported_rank(), detail::text("nccl.", operation),
                  detail::text("the communicator was aborted during initialisation (", state_->abort_reason, ")"),
                  "check NCCL_DEBUG=WARN output on every rank");
    ncclCommGetAsyncError(state_->comm, &status);
  }
  if (status != ncclSuccess) state_->fail(operation, status, "check NCCL_DEBUG=WARN output on every rank");
}

COHORT_DECL auto nccl::create_stream_and_scratch() -> void {
  int least = 0, greatest = 0;
  detail::check_cuda(cudaDeviceGetStreamPriorityRange(&least, &greatest), rank(), "stream_priority_range");
  // Communication gets the highest priority so it is not starved by compute kernels.
  detail::check_cuda(cudaStreamCreateWithPriority(&state_->stream, cudaStreamNonBlocking, greatest), rank(),
                     "stream_create");
  barrier_scratch_ = allocate(sizeof(int));
  detail::check_cuda(cudaMemset(barrier_scratch_, 0, sizeof(int)), rank(), "memset");
}

COHORT_DECL auto nccl::record_event(const char* operation) -> work {
  const detail::device_scope on_device(state_->device);
  auto event = std::make_shared<detail::nccl_event>(state_, state_->take_event());
  if (const cudaError_t status = cudaEventRecord(event->event, state_->stream); status != cudaSuccess)
    detail::check_cuda(status, rank(), detail::text("event_record(", operation, ")"));
  return work(std::move(event), operation);
}

}  // namespace cohort::inline v0
