#pragma once
// Main-process guards: side effects (downloads, logs, checkpoints) done once, safely.
//
//   if (cohort::is_main_process(pg)) ...                  global rank 0
//   cohort::on_main(pg, [&] { save_config(); });          rank 0 only; a collective on pg inside
//                                                         throws instead of hanging the others
//   cohort::main_process_first(pg, [&] { load_or_download(); });
//                                                         rank 0 first, then everyone else
//
// Rank-aware logging and printf are in cohort/run/logging.hpp, atomic writes on the main
// process in cohort/run/atomic_write.hpp.
//
// Every function is a template over any group with the members it uses (rank(), size(),
// local_rank(), barrier().wait(), ...), so they work with process_group<gloo>,
// process_group<nccl>, or a user's own type.

#include <algorithm>
#include <array>
#include <cerrno>
#include <concepts>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>

#include <fcntl.h>
#include <unistd.h>

#include "cohort/config.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0 {

// ---- what a group must offer --------------------------------------------------------------

template <class G>
concept rank_group = requires(G& group) {
  { group.rank() } -> std::convertible_to<int>;
  { group.world_size() } -> std::convertible_to<int>;
};

template <class G>
concept local_rank_group = rank_group<G> && requires(G& group) {
  { group.local_rank() } -> std::convertible_to<int>;
  { group.local_size() } -> std::convertible_to<int>;
};

template <class G>
concept barrier_group = rank_group<G> && requires(G& group) {
  group.barrier().wait();
};

namespace detail {
// Groups whose broadcast takes host memory can tell the waiting ranks whether the main
// rank's work succeeded; for the others (NCCL) a barrier is all there is.
template <class G>
concept host_broadcast_group = barrier_group<G> && requires(G& group, std::span<std::uint8_t> bytes) {
  group.broadcast(bytes, 0).wait();
  requires G::space == memory_space::host;
};
}  // namespace detail

// ---- who is main ----------------------------------------------------------------------------

template <rank_group G>
bool is_main_process(const G& group) {
  return group.rank() == 0;
}

template <local_rank_group G>
bool is_local_main_process(const G& group) {
  return group.local_rank() == 0;
}

// ---- on_main ----------------------------------------------------------------------------------

// Runs fn on the main rank only; returns its result there (std::optional, empty elsewhere).
// fn must not issue collectives on `group`: the other ranks never enter them. Groups that
// offer main_only_section() (cohort's process_group) turn such a collective into a
// cohort::error instead of a hang.
template <rank_group G, class Fn>
  requires std::invocable<Fn&>
auto on_main(G& group, Fn&& fn) {
  using result = std::invoke_result_t<Fn&>;
  auto run = [&]() -> decltype(auto) {
    if constexpr (requires { group.main_only_section(); }) {
      [[maybe_unused]] auto section = group.main_only_section();
      return std::invoke(fn);
    } else {
      return std::invoke(fn);
    }
  };
  if constexpr (std::is_void_v<result>) {
    if (group.rank() == 0) run();
  } else {
    std::optional<std::remove_cvref_t<result>> value;
    if (group.rank() == 0) value.emplace(run());
    return value;
  }
}

// ---- main first ---------------------------------------------------------------------------------

namespace detail {

// The leader has finished (maybe with `failure`); lets everyone past the same point. On
// host-broadcast groups the followers learn of the failure and throw too, rather than go on
// to read a cache or file that was never written.
template <barrier_group G>
void release_followers(G& group, bool leader, const std::exception_ptr& failure, const char* operation,
                       int leader_rank_for_message) {
  if constexpr (host_broadcast_group<G>) {
    // byte 0: 1 = failed; then the leader's message, truncated, NUL-terminated.
    std::array<std::uint8_t, 512> status{};
    if (leader && failure) {
      status[0] = 1;
      std::string text = "unknown exception";
      try {
        std::rethrow_exception(failure);
      } catch (const std::exception& e) {
        text = e.what();
      } catch (...) {}
      const auto length = std::min(text.size(), status.size() - 2);
      std::memcpy(status.data() + 1, text.data(), length);
    }
    // Everyone joins the broadcast from rank 0; a failed local leader that is not rank 0 is
    // still reported through the barrier below only (its own exception is rethrown there).
    group.broadcast(std::span<std::uint8_t>(status), 0).wait();
    group.barrier().wait();
    if (!leader && status[0] == 1)
      throw error(group.rank(), operation,
                  detail::text("rank ", std::to_string(leader_rank_for_message),
                               " failed: ", reinterpret_cast<const char*>(status.data() + 1)),
                  "fix the failure on the main rank; the other ranks did not run their part");
  } else {
    (void)failure;
    (void)operation;
    (void)leader_rank_for_message;
    group.barrier().wait();
  }
}

template <barrier_group G, class Fn>
void leader_first(G& group, bool leader, Fn& fn, const char* operation, bool report_failure,
                  bool followers_run_too = true) {
  if (leader) {
    std::exception_ptr failure;
    try {
      std::invoke(fn);
    } catch (...) {
      failure = std::current_exception();
    }
    // Always release the others, even on failure: a leader that throws before the barrier
    // would leave them waiting until their timeout.
    release_followers(group, true, report_failure ? failure : std::exception_ptr{}, operation, 0);
    if (failure) std::rethrow_exception(failure);
  } else {
    release_followers(group, false, {}, operation, 0);
    if (followers_run_too) std::invoke(fn);
  }
}

}  // namespace detail

// Rank 0 runs fn while the others wait at a barrier; then the others run fn (download once,
// then everyone reads the cache). Collective: every rank of `group` must call it. fn must not
// use `group` itself (rank 0 runs it while the others sit in a barrier). If fn throws on
// rank 0, the others are released and, on host groups (Gloo), throw a cohort::error naming
// rank 0's failure instead of running fn.
template <barrier_group G, class Fn>
  requires std::invocable<Fn&>
void main_process_first(G& group, Fn&& fn) {
  detail::leader_first(group, group.rank() == 0, fn, "main_process_first", true);
}

// Like main_process_first with local rank 0 of every node as the leader (one download per
// node, onto node-local disk). Every rank of `group` waits at one barrier, which is more
// waiting than strictly needed across nodes but needs no node-local subgroup. A leader's
// failure is not forwarded (only rank 0 can broadcast it); the followers of a failed leader
// run fn themselves.
template <barrier_group G, class Fn>
  requires local_rank_group<G> && std::invocable<Fn&>
void local_main_process_first(G& group, Fn&& fn) {
  detail::leader_first(group, group.local_rank() == 0, fn, "local_main_process_first", false);
}

}  // namespace cohort::inline v0
