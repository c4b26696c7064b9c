#pragma once
// run_ranks: one entry point for "my program's ranks", however they were started.
//
//   cohort::run_ranks(threads, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
//     cohort::process_group<cohort::gloo> pg{store, env};
//     ...
//   });
//
//   threads > 0   that many ranks as threads of this process, meeting in one memory_store
//                 (one box without a launcher, tests; what torch.multiprocessing.spawn does);
//   threads == 0  this process is one rank of a launched job: launch_env::detect() and
//                 connect_store(env) (mpirun, torchrun --no-python, srun).
//
// It returns when every rank of this process has returned. Under a launcher, rank 0 serves
// the TCP store, so before leaving it waits until every rank has finished: no rank loses its
// store because rank 0 was done first. That wait is short once any rank has failed: rank 0
// prints its own error at once and serves the store only as long as the surviving ranks
// still report in, at most run_ranks_failure_grace after the first failure it knows of
// (without any failure it is bounded by the store's timeout, and names the ranks it waits
// for after a few seconds). When ranks fail, the exception of the lowest failing rank is
// rethrown after every thread has ended.
//
// run_thread_ranks(threads, fn) is the threads > 0 half alone (threads must be positive). A
// program whose ranks are always threads (tests, one-box tools) calls it instead: run_ranks
// compiles the launched half too (launch detection, the TCP store and its server) wherever
// it is used, since which half runs is known only when it runs; header-only, that is a few
// seconds of compile time in the translation unit that calls it.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cohort/config.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/rendezvous/launch.hpp"
#include "cohort/rendezvous/store.hpp"
#include "cohort/rendezvous/tcp_store.hpp"

namespace cohort::inline v0 {

// After the first failure rank 0 knows of, how long it keeps serving the store for ranks
// that have not reported yet (each of them is failing too, or about to).
inline constexpr std::chrono::seconds run_ranks_failure_grace{10};

namespace detail {

// Launched ranks report "done" (and "failed" with the reason) to the store; rank 0 serves
// the store until all are done, or a grace period after a failure.
COHORT_DECL void finish_launched_rank(store& rendezvous, const launch_env& env, const std::exception_ptr& failure);

}  // namespace detail

// Ranks as `threads` threads of this process, meeting in one memory_store; returns when every
// thread has returned, then rethrows the exception of the lowest failing rank.
template <class Fn>
void run_thread_ranks(int threads, Fn&& fn) {
  if (threads <= 0)
    throw error(-1, "run_thread_ranks", detail::text("threads = ", std::to_string(threads)), "pass a positive count");
  auto shared = std::make_shared<memory_store>();
  std::vector<std::exception_ptr> failures(static_cast<std::size_t>(threads));
  std::vector<std::thread> ranks;
  ranks.reserve(static_cast<std::size_t>(threads));
  for (int rank = 0; rank < threads; ++rank)
    ranks.emplace_back([&, rank] {
      try {
        fn(std::shared_ptr<store>(shared), launch_env::explicit_ranks(rank, threads));
      } catch (...) {
        failures[static_cast<std::size_t>(rank)] = std::current_exception();
      }
    });
  for (auto& rank : ranks) rank.join();
  for (auto& failure : failures)
    if (failure) std::rethrow_exception(failure);
}

template <class Fn>
void run_ranks(int threads, Fn&& fn) {
  if (threads < 0)
    throw error(-1, "run_ranks", detail::text("threads = ", std::to_string(threads)),
                "pass 0 (launched) or a positive count");
  if (threads == 0) {
    const auto env = launch_env::detect();
    std::shared_ptr<store> rendezvous = connect_store(env);
    std::exception_ptr failure;
    try {
      fn(rendezvous, env);
    } catch (...) {
      failure = std::current_exception();
    }
    try {
      detail::finish_launched_rank(*rendezvous, env, failure);
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
    if (failure) std::rethrow_exception(failure);
    return;
  }
  run_thread_ranks(threads, std::forward<Fn>(fn));
}

}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/run/impl/run_ranks.ipp"
#endif
