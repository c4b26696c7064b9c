#pragma once
// Runs `ranks` through cohort::run_ranks (threads, as a trainer's own ranks), keeping each
// rank's cohort::error text and how long the whole run took: for tests of failures that must
// reach every rank within seconds, named. `body(store, env)` is one rank; what run_ranks
// throws at the end (the lowest failing rank's error again) is expected and dropped.

#include <cohort/run/run_ranks.hpp>

#include <chrono>
#include <cstddef>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace cohort_test {

struct rank_failures {
  std::vector<std::string> errors;  // by rank; empty where the rank did not fail
  double seconds = 0;
};

template <class Body>
rank_failures run_ranks_keeping_errors(int ranks, Body&& body) {
  rank_failures out;
  out.errors.resize(static_cast<std::size_t>(ranks));
  std::mutex mutex;
  const auto started = std::chrono::steady_clock::now();
  try {
    cohort::run_ranks(ranks, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
      try {
        body(std::move(store), env);
      } catch (const cohort::error& failure) {
        std::lock_guard lock(mutex);
        out.errors[static_cast<std::size_t>(env.rank)] = failure.what();
        throw;
      }
    });
  } catch (const std::exception&) {}
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return out;
}

}  // namespace cohort_test
