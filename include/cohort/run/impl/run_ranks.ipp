#pragma once
// cohort/run/run_ranks.hpp's definitions: header-only, cold templates (COHORT_COLD), so that
// only a unit that runs ranks instantiates them; compiled once by <cohort/src.hpp> under
// COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>
#include "cohort/comm/detail/failure_report.hpp"
#include "cohort/detail/progress.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/rendezvous/detail/job_identity.hpp"
#include "cohort/rendezvous/launch.hpp"
#include "cohort/rendezvous/store.hpp"
#include "cohort/rendezvous/tcp_store.hpp"

#include "cohort/config.hpp"
#include "cohort/run/run_ranks.hpp"

namespace cohort::inline v0 {
namespace detail {

// What one of a rank's process groups said when it was destroyed or failed (its status key:
// a group that failed keeps that status, its counts final); nullopt for a group that has said
// neither (still alive, or its creation failed).
using group_end = std::optional<rank_status>;

// The process groups `rank` made on `rendezvous` (process_group numbers them per rank:
// cohort/groups_created/<rank>, then cohort/pg<n>/) and their ends.
COHORT_COLD inline std::vector<group_end> groups_of(store& rendezvous, int rank, std::chrono::milliseconds bound) {
  const std::string made = detail::text("cohort/groups_created/", std::to_string(rank));
  const std::int64_t count = rendezvous.add_within(made, 0, bound);
  std::vector<group_end> groups;
  for (std::int64_t n = 1; n <= count; ++n) {
    const std::string key = detail::text("cohort/pg", std::to_string(n), "/status/", std::to_string(rank));
    rank_status status;
    if (rendezvous.check(std::span<const std::string>(&key, 1)) &&
        decode_status(to_string(rendezvous.get(key, bound)), status) &&
        (status.activity == rank_activity::left || status.activity == rank_activity::failed))
      groups.emplace_back(std::move(status));
    else
      groups.emplace_back();
  }
  return groups;
}

COHORT_COLD_BODY std::string compare_collective_counts(store& rendezvous, int world) {
  const auto bound = std::min<std::chrono::milliseconds>(run_ranks_exit_bound, rendezvous.timeout());
  std::vector<std::vector<group_end>> ranks;
  for (int r = 0; r < world; ++r) ranks.push_back(groups_of(rendezvous, r, bound));
  std::vector<std::string> parts;
  std::size_t groups = 0;
  for (const auto& mine : ranks) groups = std::max(groups, mine.size());
  for (std::size_t g = 0; g < groups; ++g) {
    // Ranks by the collectives they issued on their g-th group, kind by kind (ranks whose end
    // is not known are left out: they are still running it, or failed to make it).
    std::map<std::array<std::uint64_t, call_kinds>, std::vector<int>> by_count;
    for (int r = 0; r < world; ++r) {
      const auto& mine = ranks[static_cast<std::size_t>(r)];
      if (g < mine.size() && mine[g]) by_count[mine[g]->by_kind].push_back(r);
    }
    if (by_count.size() < 2) continue;
    // The fewest ranks first: they stopped early or late against the others.
    std::vector<std::pair<std::array<std::uint64_t, call_kinds>, std::vector<int>>> sets;
    for (std::size_t fewest = 1; sets.size() < by_count.size(); ++fewest)
      for (const auto& set : by_count)
        if (set.second.size() == fewest) sets.push_back(set);
    std::string text = detail::text("pg", std::to_string(g + 1), ": ");
    for (std::size_t k = 0; k < sets.size(); ++k) {
      const auto& [counts, who] = sets[k];
      const rank_status& end = *ranks[static_cast<std::size_t>(who.front())][g];
      text += detail::text((k ? "; " : ""), format_ranks(who), " issued ", describe_counts(counts),
                           (end.call.sequence != 0 ? detail::text(" (", (who.size() == 1 ? "its" : "their"),
                                                                  " last: ", describe(end.call), ")")
                                                   : std::string()));
    }
    parts.push_back(std::move(text));
  }
  std::map<std::size_t, std::vector<int>> by_groups;
  for (int r = 0; r < world; ++r) by_groups[ranks[static_cast<std::size_t>(r)].size()].push_back(r);
  if (by_groups.size() > 1) {
    std::string text = "process groups made: ";
    bool first = true;
    for (const auto& [made, who] : by_groups) {
      text += detail::text((first ? "" : ", "), format_ranks(who), " made ", std::to_string(made));
      first = false;
    }
    parts.push_back(std::move(text));
  }
  std::string joined;
  for (const auto& part : parts) joined += detail::text((joined.empty() ? "" : "; "), part);
  return joined;
}

inline constexpr std::string_view run_ranks_keys = "cohort/run_ranks/";

COHORT_COLD [[gnu::cold]] inline std::string outcome_key(int rank) {
  return detail::text(run_ranks_keys, "outcome/", std::to_string(rank));
}

// Rank 0: the job's collided mark, every rank's outcome, the counts of their groups: the
// verdict on the run (empty when every rank ended well and the counts agree).
COHORT_COLD [[gnu::cold]] inline std::string judge_run(store& rendezvous, const launch_env& env,
                                                       std::chrono::milliseconds bound,
                                                       std::chrono::steady_clock::duration waited,
                                                       const std::string& own_failure) {
  std::vector<int> failed, missing;
  std::string first_reason;
  if (!own_failure.empty()) {
    failed.push_back(0);
    first_reason = own_failure.substr(0, own_failure.find('\n'));
  }
  for (int r = 1; r < env.world_size; ++r) {
    const std::string key = outcome_key(r);
    if (!rendezvous.check(std::span<const std::string>(&key, 1))) {
      missing.push_back(r);
      continue;
    }
    const std::string outcome = to_string(rendezvous.get(key, bound));
    if (outcome.rfind("failed\n", 0) == 0) {
      failed.push_back(r);
      if (first_reason.empty()) {
        first_reason = outcome.substr(7);
        first_reason = first_reason.substr(0, first_reason.find('\n'));
      }
    }
  }
  std::vector<std::string> parts;
  // A process of another job (no distinct id) that claimed a rank first trained with this
  // job's ranks; this job's own rank, later, marked the job: no rank of it ends well.
  if (job_marked_collided(rendezvous))
    parts.push_back(job_collision_error(rendezvous, 0, "run_ranks", "its ranks computed with another job's").detail());
  if (!failed.empty())
    parts.push_back(detail::text(
        format_ranks(failed), " failed (",
        (failed.size() == 1 ? "" : detail::text("rank ", std::to_string(failed.front()), ": ")), first_reason, ")"));
  if (!missing.empty())
    parts.push_back(detail::text(format_ranks(missing), " did not report the end of ",
                                 (missing.size() == 1 ? "its" : "their"), " run within ", format_seconds(waited),
                                 " (died, stopped, or cut off from rank 0's store)"));
  if (const std::string counts = compare_collective_counts(rendezvous, env.world_size); !counts.empty())
    parts.push_back(detail::text("the ranks issued different numbers of collectives: ", counts));
  std::string verdict;
  for (const auto& part : parts) verdict += detail::text((verdict.empty() ? "" : "; "), part);
  return verdict;
}

COHORT_COLD_BODY void finish_launched_rank(store& rendezvous, const launch_env& env,
                                           const std::exception_ptr& failure) {
  using clock = std::chrono::steady_clock;
  const auto started = clock::now();
  const auto bound = std::min<std::chrono::milliseconds>(run_ranks_exit_bound, rendezvous.timeout());
  const std::string base(run_ranks_keys);
  const std::string where = rendezvous.location();
  const auto unreachable = [&](const std::exception& cause, std::string_view doing,
                               std::string_view hint =
                                   "rank 0's node is lost or cut off from this one, or rank 0 "
                                   "ended first") {
    const auto* known = dynamic_cast<const error*>(&cause);
    return error(env.rank, "run_ranks",
                 detail::text("cannot reach rank 0's store", (where.empty() ? "" : detail::text(" at ", where)), " to ",
                              doing, " (", (known ? known->detail() : std::string(cause.what())), ")"),
                 std::string(hint));
  };
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
  }
  const auto lines_every = default_progress_interval();

  if (env.rank != 0) {
    // A SET waits for no answer: a failing rank's report costs nothing even cut off from the
    // store, and its own error is the news.
    try {
      const bytes outcome = to_bytes(failure ? detail::text("failed\n", reason) : std::string("ok"));
      rendezvous.set_within(outcome_key(env.rank), std::span<const std::uint8_t>(outcome), bound);
      // A failing rank waits for no answer long: cut off, it would only wait in vain.
      const auto answer = failure ? std::chrono::milliseconds(200) : bound;
      if (failure) rendezvous.add_within(detail::text(base, "failed"), 1, answer);
      rendezvous.add_within(detail::text(base, "reported"), 1, answer);
    } catch (const std::exception& cause) {
      if (failure) return;
      throw unreachable(cause, "report the end of its run");
    }
    if (failure) {
      std::fprintf(stderr, "%s\n", reason.c_str());  // the news, at once; then rank 0's verdict
      std::fflush(stderr);
    }
    // Rank 0's verdict on the whole run, in slices each bounded (a store gone silent ends this
    // within a slice). A failed rank waits rank 0's grace at most (the verdict is only news).
    // A rank that ended well waits the store's timeout, then for as long as rank 0 lives: its
    // store answers from a thread of its own, so a rank 0 that saves, evaluates or uploads
    // alone after the last collective for longer is told from one that died (its store
    // closes, or stops answering within a request's bound) and the job ends well.
    progress_clock lines(lines_every, started);
    const auto give_up =
        started + (failure ? std::chrono::duration_cast<std::chrono::milliseconds>(run_ranks_failure_grace + bound)
                           : rendezvous.timeout());
    bool rank0_works_alone = false;
    const auto rank0_ended = [&](const std::exception& cause) {
      return unreachable(cause,
                         detail::text("learn how the run ended, after waiting ", format_seconds(lines.elapsed()),
                                      " while rank 0 worked alone (its store answered until now)"),
                         "rank 0 ended without saying how the run ended (it died or was killed, or its node was "
                         "lost): its own exit status and output say why");
    };
    std::string verdict;
    for (;;) {
      const auto now = clock::now();
      const auto slice_ends = rank0_works_alone ? lines.next() : std::min(give_up, lines.next());
      const auto slice = std::clamp(std::chrono::duration_cast<std::chrono::milliseconds>(slice_ends - now),
                                    std::chrono::milliseconds(1), bound);
      try {
        verdict = to_string(rendezvous.get(detail::text(base, "verdict"), slice));
        break;
      } catch (const timeout_error&) {
        if (clock::now() >= give_up) {
          if (failure) return;
          try {
            rendezvous.add_within(detail::text(base, "reported"), 0, bound);  // rank 0 lives: its store answers
          } catch (const std::exception& cause) {
            throw rank0_ended(cause);
          }
          rank0_works_alone = true;
        }
        if (lines.due())
          progress_line(
              env.rank,
              rank0_works_alone
                  ? detail::text("run_ranks: finished; rank 0 has not said how the run ended after ",
                                 format_seconds(lines.elapsed()), " (past the store's ",
                                 format_duration(rendezvous.timeout()),
                                 "), but lives (its store answers): it works alone, or waits for a rank; "
                                 "waiting for as long as it lives")
                  : detail::text(
                        "run_ranks: ", (failure ? "failed" : "finished"), "; waiting ", format_seconds(lines.elapsed()),
                        " for rank 0 to hear from every rank (",
                        (failure ? detail::text("at most ",
                                                format_duration(std::chrono::duration_cast<std::chrono::milliseconds>(
                                                    run_ranks_failure_grace + bound)))
                                 : detail::text("the store's ", format_duration(rendezvous.timeout()),
                                                ", then as long as rank 0 lives")),
                        ")"));
      } catch (const std::exception& cause) {
        if (failure) return;
        if (rank0_works_alone) throw rank0_ended(cause);
        throw unreachable(cause, "learn how the run ended");
      }
    }
    try {
      rendezvous.add_within(detail::text(base, "acknowledged"), 1, bound);
    } catch (const std::exception&) {}
    if (failure) {
      if (!verdict.empty()) progress_line(env.rank, detail::text("run_ranks: the run failed: ", verdict));
      return;
    }
    if (!verdict.empty())
      throw error(env.rank, "run_ranks", detail::text("this rank finished, but the run failed: ", verdict),
                  "the first failing rank's error names the cause");
    return;
  }

  // Rank 0 serves the store: it waits for every rank's report, then publishes the verdict
  // and serves until the ranks waiting for it have read it.
  std::optional<clock::time_point> grace_ends;
  const auto grace = [&] {
    return clock::now() + std::min<clock::duration>(run_ranks_failure_grace, rendezvous.timeout());
  };
  if (failure) {
    // Said now, not after the wait: this rank's error is the news.
    std::fprintf(stderr, "%s\ncohort [rank 0] run_ranks: serving the store at most %lld s more for the other ranks\n",
                 reason.c_str(), static_cast<long long>(run_ranks_failure_grace.count()));
    std::fflush(stderr);
    grace_ends = grace();
  }
  const auto give_up = started + rendezvous.timeout();
  progress_clock lines(lines_every, started);
  auto pause = std::chrono::milliseconds(2);
  const auto done_waiting = [&] { return clock::now() >= (grace_ends ? std::min(*grace_ends, give_up) : give_up); };
  try {
    while (rendezvous.add_within(detail::text(base, "reported"), 0, bound) < env.world_size - 1 && !done_waiting()) {
      if (!grace_ends && rendezvous.add_within(detail::text(base, "failed"), 0, bound) > 0) grace_ends = grace();
      if (lines.due()) {
        std::vector<int> missing;
        for (int r = 1; r < env.world_size; ++r) {
          const std::string key = outcome_key(r);
          if (!rendezvous.check(std::span<const std::string>(&key, 1))) missing.push_back(r);
        }
        progress_line(0, detail::text("run_ranks: ", (failure ? "failed" : "done"), "; serving the store until ",
                                      format_ranks(missing), " finish (", format_seconds(lines.elapsed()), " of ",
                                      format_duration(rendezvous.timeout()), ")"));
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(50));
    }
    const std::string verdict = judge_run(rendezvous, env, bound, clock::now() - started, reason);
    const bytes said = to_bytes(verdict);
    rendezvous.set_within(detail::text(base, "verdict"), std::span<const std::uint8_t>(said), bound);
    if (!verdict.empty() && failure) progress_line(0, detail::text("run_ranks: the run failed: ", verdict));
    // Every rank that reported reads the verdict: serve until they have. Each waits for it in
    // a request the store answers as soon as it is set, so a rank that has not read it within
    // a request's bound is gone (killed, or cut off since it reported): not waited for longer.
    // That bound holds even when the grace for a rank that never reported is over: leaving at
    // once, this rank closed the store under readers whose answer was still on its way.
    const std::int64_t waiting = rendezvous.add_within(detail::text(base, "reported"), 0, bound);
    const auto read_by = clock::now() + bound;
    std::int64_t acknowledged = 0;
    while ((acknowledged = rendezvous.add_within(detail::text(base, "acknowledged"), 0, bound)) < waiting &&
           clock::now() < read_by) {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(50));
    }
    if (acknowledged < waiting && clock::now() >= read_by)
      progress_line(
          0, detail::text("run_ranks: ", std::to_string(waiting - acknowledged), " of the ", std::to_string(waiting),
                          " ranks that reported did not read the verdict within ", format_duration(bound),
                          ": gone since (killed, or cut off from this node); not waiting for them"));
    if (!verdict.empty() && !failure)
      throw error(0, "run_ranks", detail::text("this rank finished, but the run failed: ", verdict),
                  "the first failing rank's error names the cause");
  } catch (const error&) {
    if (failure) return;
    throw;
  }
}

COHORT_COLD_BODY void run_thread_ranks(int threads, const rank_function& fn) {
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
  if (const std::string counts = compare_collective_counts(*shared, threads); !counts.empty())
    throw error(-1, "run_ranks", counts,
                "every rank must issue the same collectives: a rank that stops early or late leaves the others "
                "waiting (or a call of its own unanswered)");
}

COHORT_COLD_BODY void run_ranks(int threads, const rank_function& fn) {
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
      finish_launched_rank(*rendezvous, env, failure);
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
    if (failure) std::rethrow_exception(failure);
    return;
  }
  run_thread_ranks(threads, fn);
}

}  // namespace detail
}  // namespace cohort::inline v0
