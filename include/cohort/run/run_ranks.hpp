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
// The ends agree. When every rank's function has returned, the ranks compare how many
// collectives each issued on each of its process groups (the groups say so in the store when
// they are destroyed): a rank that stopped early or late is named with both counts ("pg1:
// rank 3 issued 41 collectives (its last: ...), ranks 0, 1, 2 issued 61"), and then no rank
// returns normally while another failed.
//
// Threads: returns when every thread has returned; rethrows the exception of the lowest
// failing rank, or throws the counts that differ.
//
// Launched: each rank reports its end (and, failing, why) to rank 0's store. A rank that
// failed leaves at once with its own error. One that did not waits for rank 0's verdict on
// the run (the failures and counts of every rank) and throws it unless every rank ended well:
// so the exit codes of all ranks say the run failed. It waits the store's timeout, then for
// as long as rank 0 lives (its store answers: rank 0 may save, evaluate or upload alone after
// the last collective for longer), and a rank 0 that dies meanwhile is named. Rank 0, which
// serves the store, stays until every rank has reported and read the verdict: as long as the
// store's timeout while everyone is well (naming the ranks it waits for every progress
// interval), at most run_ranks_failure_grace after the first failure it knows of. Every store
// request on the way out waits at most run_ranks_exit_bound for an answer: a rank cut off from
// rank 0's node (or orphaned by its loss) leaves within seconds, saying so, not after the
// store's timeout.
//
// run_thread_ranks(threads, fn) is the threads > 0 half alone (threads must be positive). A
// program whose ranks are always threads (tests, one-box tools) calls it instead: run_ranks
// compiles the launched half too (launch detection, the TCP store and its server) wherever
// it is used, since which half runs is known only when it runs; header-only, that is a few
// seconds of compile time in the translation unit that calls it.

#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "cohort/config.hpp"
#include "cohort/error.hpp"
#include "cohort/rendezvous/launch.hpp"
#include "cohort/rendezvous/store.hpp"
#include "cohort/rendezvous/tcp_store.hpp"

namespace cohort::inline v0 {

// After the first failure rank 0 knows of, how long it keeps serving the store for ranks
// that have not reported yet (each of them is failing too, or about to).
inline constexpr std::chrono::seconds run_ranks_failure_grace{5};
// The longest any store request on run_ranks' way out waits for an answer.
inline constexpr std::chrono::seconds run_ranks_exit_bound{5};

namespace detail {

// What the counts of the ranks' process groups show (empty when they agree): each rank's
// groups are read from their status keys under `rendezvous` (world ranks).
COHORT_COLD std::string compare_collective_counts(store& rendezvous, int world);

// Launched ranks report their end (and failing, why) to the store and read rank 0's verdict;
// rank 0 serves the store until every rank has, or a grace period after a failure. Throws
// the verdict on a rank that did not fail itself (the caller rethrows its own failure).
COHORT_COLD [[gnu::cold]] void finish_launched_rank(store& rendezvous, const launch_env& env,
                                                    const std::exception_ptr& failure);

// The trainer's function as the ranks' bodies call it: the bodies (threads, or the launched
// rank's detection, store and end) are compiled once, in src.hpp, rather than instantiated
// with each program's lambda in every unit that calls run_ranks (issue 44: about a third of a
// CUDA trainer unit's code and of its host compile's memory). Refers to the caller's
// callable, which outlives the call.
class rank_function {
 public:
  template <class Call>
    requires(!std::is_same_v<std::remove_cv_t<Call>, rank_function>)  // a copy refers to the callable
  explicit rank_function(Call& call) noexcept
      : object_(&call), call_([](void* object, std::shared_ptr<store> rendezvous, launch_env env) {
          (*static_cast<Call*>(object))(std::move(rendezvous), std::move(env));
        }) {}
  void operator()(std::shared_ptr<store> rendezvous, launch_env env) const {
    call_(object_, std::move(rendezvous), std::move(env));
  }

 private:
  void* object_;
  void (*call_)(void* object, std::shared_ptr<store> rendezvous, launch_env env);
};

// Header-only, cold (config.hpp): a unit that includes run_ranks.hpp and calls neither does not
// instantiate the threads, the launched half or the collective counts' comparison.
COHORT_COLD void run_thread_ranks(int threads, const rank_function& fn);
COHORT_COLD void run_ranks(int threads, const rank_function& fn);

}  // namespace detail

// Ranks as `threads` threads of this process, meeting in one memory_store; returns when every
// thread has returned, then rethrows the exception of the lowest failing rank (or throws the
// collective counts that differ, when no rank failed).
template <class Fn>
void run_thread_ranks(int threads, Fn&& fn) {
  auto call = [&fn](std::shared_ptr<store> rendezvous, launch_env env) { fn(std::move(rendezvous), std::move(env)); };
  detail::run_thread_ranks(threads, detail::rank_function(call));
}

template <class Fn>
void run_ranks(int threads, Fn&& fn) {
  auto call = [&fn](std::shared_ptr<store> rendezvous, launch_env env) { fn(std::move(rendezvous), std::move(env)); };
  detail::run_ranks(threads, detail::rank_function(call));
}

}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/run/impl/run_ranks.ipp"
#endif
