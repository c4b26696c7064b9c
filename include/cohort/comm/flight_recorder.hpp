#pragma once
// flight_recorder: a fixed-size ring of a group's last communication calls (sequence, kind,
// dtype, count, op, peer, tag; issued/started/completed times; state), which every backend
// keeps (gloo::recorder(), nccl::recorder()) and writes to COHORT_TRACE_DIR when a call
// fails. Recording a call takes one uncontended lock and a clock read per state change, next
// to a collective's tens of microseconds at the least; capacity 0 turns it off.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string_view>
#include <vector>

#include "cohort/comm/call_label.hpp"
#include "cohort/config.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0 {

// What a group does when its watchdog finds a failure that no cohort call has reported
// (a collective that failed or timed out while nobody waited for it, an NCCL kernel stuck
// past the timeout behind which the caller's stream waits, an NCCL asynchronous error).
enum class async_error_handling {
  // Print the error, record it for the launcher (TORCHELASTIC_ERROR_FILE), write the trace
  // and end the process with exit status 1, as PyTorch's default (TORCH_NCCL_ASYNC_ERROR_HANDLING)
  // does: a rank that goes on computing with a broken group only hangs later, elsewhere.
  abort_process,
  // Keep the error: the group's next call throws it.
  throw_on_next_call,
};

enum class call_kind : std::uint8_t {
  all_reduce,
  reduce_scatter,
  all_gather,
  broadcast,
  all_to_all,
  barrier,
  send,
  recv
};
inline constexpr std::size_t call_kinds = 8;
enum class call_state : std::uint8_t { issued, started, completed, failed };

COHORT_DECL std::string_view to_string(call_kind kind);
COHORT_DECL std::string_view to_string(call_state state);

namespace detail {
inline bool is_point_to_point(call_kind kind) { return kind == call_kind::send || kind == call_kind::recv; }
}  // namespace detail

struct call_record {
  std::uint64_t id = 0;  // the recorder's running number: which call owns a ring slot
  // Collectives count 1, 2, ... per group in issue order; point-to-point calls count per
  // (peer, tag, direction), so the n-th send to B with tag t matches B's n-th recv with t.
  std::uint64_t sequence = 0;
  call_kind kind = call_kind::all_reduce;
  dtype type = dtype::uint8;
  op reduce = op::sum;
  int peer = -1;  // root for broadcast, the other rank for send/recv
  std::uint64_t tag = 0;
  std::size_t count = 0;  // elements (per rank for reduce_scatter, all_gather, all_to_all)
  // Microseconds since the epoch (system clock, so files of several hosts compare); 0: not yet.
  std::int64_t issued_us = 0;
  std::int64_t started_us = 0;
  std::int64_t completed_us = 0;
  call_state state = call_state::issued;
  call_label context{};  // the issuing group's call_context when the call was issued
};

class flight_recorder {
 public:
  COHORT_DECL explicit flight_recorder(std::size_t capacity);

  bool enabled() const noexcept { return !ring_.empty(); }
  std::size_t capacity() const noexcept { return ring_.size(); }

  // Records a call as issued at `when` and returns its id for the updates below (0 when
  // disabled). A caller that has read the clock already passes its reading: one read a call.
  COHORT_DECL std::uint64_t issued(const call_record& call,
                                   std::chrono::steady_clock::time_point when = std::chrono::steady_clock::now());
  void started(std::uint64_t id) { update(id, call_state::started, 0); }
  // `collective_sequence`: the call's sequence when it is a collective (0 otherwise), so the
  // last-completed mark advances even when the ring has already recycled the call's slot.
  void completed(std::uint64_t id, std::uint64_t collective_sequence) {
    update(id, call_state::completed, collective_sequence);
  }
  void failed(std::uint64_t id) { update(id, call_state::failed, 0); }

  // The newest call's id (0: none, or disabled). Read before and after issuing, it brackets
  // the ids of the calls issued between.
  COHORT_DECL std::uint64_t last_id() const;
  // Calls first..last (ids) as one span of the engine's work: the first one's issue to the
  // last completion, on the steady clock (microseconds). `pending` while one is not complete;
  // `lost` when one failed or the ring no longer holds it.
  struct calls_span {
    enum class state : std::uint8_t { complete, pending, lost };
    state outcome = state::lost;
    std::chrono::steady_clock::time_point issued{}, completed{};
  };
  COHORT_DECL calls_span span_of(std::uint64_t first, std::uint64_t last) const;

  // The calls still in the ring, oldest first.
  COHORT_DECL std::vector<call_record> snapshot() const;
  // Highest collective sequence issued / completed (0: none).
  COHORT_DECL std::uint64_t last_issued() const;
  COHORT_DECL std::uint64_t last_completed() const;

 private:
  COHORT_DECL void update(std::uint64_t id, call_state state, std::uint64_t collective_sequence);
  // Microseconds since the epoch for a steady-clock reading: the system clock's offset is
  // read once, so each state change costs one clock read and the times never go backwards.
  std::int64_t epoch_us(std::chrono::steady_clock::time_point when) const noexcept {
    return std::chrono::duration_cast<std::chrono::microseconds>(when.time_since_epoch()).count() + epoch_offset_us_;
  }

  std::int64_t epoch_offset_us_ = 0;
  mutable std::mutex mutex_;
  std::vector<call_record> ring_;
  std::uint64_t next_id_ = 0;
  std::uint64_t last_issued_ = 0;
  std::uint64_t last_completed_ = 0;
};

namespace detail {
// Microseconds on the wall clock: what a trace's timestamps and the recorder's epoch are in.
COHORT_DECL std::int64_t now_us();
}  // namespace detail

}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/comm/impl/flight_recorder.ipp"
#endif
