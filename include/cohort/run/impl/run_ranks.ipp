#pragma once
// cohort/run/run_ranks.hpp's definitions: inline there when header-only, compiled once by <cohort/src.hpp>
// under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

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
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/rendezvous/launch.hpp"
#include "cohort/rendezvous/store.hpp"
#include "cohort/rendezvous/tcp_store.hpp"

#include "cohort/config.hpp"
#include "cohort/run/run_ranks.hpp"

namespace cohort::inline v0 {
namespace detail {

COHORT_DECL void finish_launched_rank(store& rendezvous, const launch_env& env, const std::exception_ptr& failure) {
  const std::string base = "cohort/run_ranks/";
  std::string reason;
  if (failure) {
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& raised) {
      reason = raised.what();
      record_error_for_launcher(raised);
    } catch (...) {
      reason = "an exception that is not a std::exception";
      record_error_for_launcher("unknown", reason);
    }
    rendezvous.set(detail::text(base, "failure/", std::to_string(env.rank)), reason);
    rendezvous.add(detail::text(base, "failed"), 1);
  }
  rendezvous.set(detail::text(base, "done/", std::to_string(env.rank)), "1");
  rendezvous.add(detail::text(base, "done"), 1);
  if (env.rank != 0) return;

  using clock = std::chrono::steady_clock;
  const auto started = clock::now();
  const auto give_up = started + rendezvous.timeout();
  std::optional<clock::time_point> grace_ends;
  if (failure) grace_ends = started + std::min<clock::duration>(run_ranks_failure_grace, rendezvous.timeout());
  bool said_why_waiting = false;
  auto pause = std::chrono::milliseconds(2);
  while (rendezvous.add(detail::text(base, "done"), 0) < env.world_size) {
    const auto now = clock::now();
    if (failure && !said_why_waiting) {
      // Said now, not after the wait: this rank's error is the news.
      said_why_waiting = true;
      std::fprintf(stderr, "%s\ncohort [rank 0] run_ranks: serving the store at most %lld s more for the other ranks\n",
                   reason.c_str(), static_cast<long long>(run_ranks_failure_grace.count()));
    }
    if (now >= give_up || (grace_ends && now >= *grace_ends)) return;
    if (!grace_ends && rendezvous.add(detail::text(base, "failed"), 0) > 0)
      grace_ends = now + std::min<clock::duration>(run_ranks_failure_grace, rendezvous.timeout());
    if (!grace_ends && !said_why_waiting && now - started >= std::chrono::seconds(5)) {
      said_why_waiting = true;
      std::string missing;
      for (int r = 1; r < env.world_size; ++r) {
        const std::string key = detail::text(base, "done/", std::to_string(r));
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
}  // namespace cohort::inline v0
