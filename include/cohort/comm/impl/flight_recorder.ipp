#pragma once
// The flight recorder's definitions (cohort/comm/flight_recorder.hpp): inline there when
// header-only, compiled once by <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION (see
// cohort/config.hpp). What reports a failure from the ring is in impl/failure_report.ipp.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string_view>
#include <vector>

#include "cohort/comm/flight_recorder.hpp"
#include "cohort/config.hpp"

namespace cohort::inline v0 {

COHORT_DECL std::string_view to_string(call_kind kind) {
  switch (kind) {
    case call_kind::all_reduce: return "all_reduce";
    case call_kind::reduce_scatter: return "reduce_scatter";
    case call_kind::all_gather: return "all_gather";
    case call_kind::broadcast: return "broadcast";
    case call_kind::all_to_all: return "all_to_all";
    case call_kind::barrier: return "barrier";
    case call_kind::send: return "send";
    case call_kind::recv: return "recv";
  }
  return "?";
}

COHORT_DECL std::string_view to_string(call_state state) {
  switch (state) {
    case call_state::issued: return "issued";
    case call_state::started: return "started";
    case call_state::completed: return "completed";
    case call_state::failed: return "failed";
  }
  return "?";
}

COHORT_DECL flight_recorder::flight_recorder(std::size_t capacity) : ring_(capacity) {
  const auto steady = std::chrono::steady_clock::now();
  epoch_offset_us_ =
      detail::now_us() - std::chrono::duration_cast<std::chrono::microseconds>(steady.time_since_epoch()).count();
}

COHORT_DECL std::uint64_t flight_recorder::issued(const call_record& call, std::chrono::steady_clock::time_point when) {
  if (ring_.empty()) return 0;
  const std::int64_t now = epoch_us(when);
  std::lock_guard lock(mutex_);
  const std::uint64_t id = ++next_id_;
  call_record& slot = ring_[id % ring_.size()];
  slot = call;
  slot.id = id;
  slot.issued_us = now;
  slot.started_us = 0;
  slot.completed_us = 0;
  slot.state = call_state::issued;
  if (!detail::is_point_to_point(call.kind)) last_issued_ = std::max(last_issued_, call.sequence);
  return id;
}

COHORT_DECL void flight_recorder::update(std::uint64_t id, call_state state, std::uint64_t collective_sequence) {
  if (id == 0 || ring_.empty()) return;
  const std::int64_t now = epoch_us(std::chrono::steady_clock::now());
  std::lock_guard lock(mutex_);
  last_completed_ = std::max(last_completed_, collective_sequence);
  call_record& slot = ring_[id % ring_.size()];
  if (slot.id != id) return;  // overwritten: the ring has moved on
  slot.state = state;
  if (state == call_state::started)
    slot.started_us = now;
  else
    slot.completed_us = now;
}

COHORT_DECL std::vector<call_record> flight_recorder::snapshot() const {
  std::lock_guard lock(mutex_);
  std::vector<call_record> calls;
  if (ring_.empty()) return calls;
  const std::uint64_t oldest = next_id_ >= ring_.size() ? next_id_ - ring_.size() + 1 : 1;
  for (std::uint64_t id = oldest; id <= next_id_; ++id) {
    const call_record& slot = ring_[id % ring_.size()];
    if (slot.id == id) calls.push_back(slot);
  }
  return calls;
}

COHORT_DECL std::uint64_t flight_recorder::last_id() const {
  std::lock_guard lock(mutex_);
  return next_id_;
}

COHORT_DECL flight_recorder::calls_span flight_recorder::span_of(std::uint64_t first, std::uint64_t last) const {
  calls_span span;
  if (ring_.empty() || first == 0 || last < first) return span;
  std::int64_t issued_us = 0, completed_us = 0;
  {
    std::lock_guard lock(mutex_);
    for (std::uint64_t id = first; id <= last; ++id) {
      const call_record& slot = ring_[id % ring_.size()];
      if (slot.id != id || slot.state == call_state::failed) return span;
      if (slot.state != call_state::completed) {
        span.outcome = calls_span::state::pending;
        return span;
      }
      if (id == first) issued_us = slot.issued_us;
      completed_us = std::max(completed_us, slot.completed_us);
    }
  }
  const auto steady = [&](std::int64_t epoch_us) {
    return std::chrono::steady_clock::time_point(std::chrono::microseconds(epoch_us - epoch_offset_us_));
  };
  span.outcome = calls_span::state::complete;
  span.issued = steady(issued_us);
  span.completed = steady(completed_us);
  return span;
}

COHORT_DECL std::uint64_t flight_recorder::last_issued() const {
  std::lock_guard lock(mutex_);
  return last_issued_;
}

COHORT_DECL std::uint64_t flight_recorder::last_completed() const {
  std::lock_guard lock(mutex_);
  return last_completed_;
}

}  // namespace cohort::inline v0

namespace cohort::inline v0::detail {

COHORT_DECL std::int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace cohort::inline v0::detail
