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

#include "cohort/error.hpp"
#include "cohort/launch.hpp"
#include "cohort/store.hpp"
#include "cohort/tcp_store.hpp"

namespace cohort::inline v0 {

// After the first failure rank 0 knows of, how long it keeps serving the store for ranks
// that have not reported yet (each of them is failing too, or about to).
inline constexpr std::chrono::seconds run_ranks_failure_grace{10};

namespace detail {

// Launched ranks report "done" (and "failed" with the reason) to the store; rank 0 serves
// the store until all are done, or a grace period after a failure.
inline void finish_launched_rank(store& rendezvous, const launch_env& env, const std::exception_ptr& failure) {
  const std::string base = "cohort/run_ranks/";
  std::string reason;
  if (failure) {
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& raised) {
      reason = raised.what();
    } catch (...) {
      reason = "an exception that is not a std::exception";
    }
    rendezvous.set(base + "failure/" + std::to_string(env.rank), reason);
    rendezvous.add(base + "failed", 1);
  }
  rendezvous.set(base + "done/" + std::to_string(env.rank), "1");
  rendezvous.add(base + "done", 1);
  if (env.rank != 0) return;

  using clock = std::chrono::steady_clock;
  const auto started = clock::now();
  const auto give_up = started + rendezvous.timeout();
  std::optional<clock::time_point> grace_ends;
  if (failure) grace_ends = started + std::min<clock::duration>(run_ranks_failure_grace, rendezvous.timeout());
  bool said_why_waiting = false;
  auto pause = std::chrono::milliseconds(2);
  while (rendezvous.add(base + "done", 0) < env.world_size) {
    const auto now = clock::now();
    if (failure && !said_why_waiting) {
      // Said now, not after the wait: this rank's error is the news.
      said_why_waiting = true;
      std::fprintf(stderr, "%s\ncohort [rank 0] run_ranks: serving the store at most %lld s more for the other ranks\n",
                   reason.c_str(), static_cast<long long>(run_ranks_failure_grace.count()));
    }
    if (now >= give_up || (grace_ends && now >= *grace_ends)) return;
    if (!grace_ends && rendezvous.add(base + "failed", 0) > 0)
      grace_ends = now + std::min<clock::duration>(run_ranks_failure_grace, rendezvous.timeout());
    if (!grace_ends && !said_why_waiting && now - started >= std::chrono::seconds(5)) {
      said_why_waiting = true;
      std::string missing;
      for (int r = 1; r < env.world_size; ++r) {
        const std::string key = base + "done/" + std::to_string(r);
        if (!rendezvous.check(std::span<const std::string>(&key, 1)))
          missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      std::fprintf(stderr, "cohort [rank 0] run_ranks: done; serving the store until rank(s) %s finish (at most %s)\n",
                   missing.c_str(), format_duration(rendezvous.timeout()).c_str());
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
}

}  // namespace detail

template <class Fn>
void run_ranks(int threads, Fn&& fn) {
  if (threads < 0)
    throw error(-1, "run_ranks", "threads = " + std::to_string(threads), "pass 0 (launched) or a positive count");
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

}  // namespace cohort::inline v0
