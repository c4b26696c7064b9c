#pragma once
// cohort/diagnostics/straggler.hpp's definitions: header-only, cold templates (COHORT_COLD), so
// that only a unit that makes a report or summarizes one instantiates them; compiled once by
// <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <time.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cohort/config.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/diagnostics/straggler.hpp"
#include "cohort/diagnostics/timeline.hpp"
#include "cohort/error.hpp"
#include "cohort/rendezvous/store.hpp"

namespace cohort::inline v0 {
namespace detail::straggler_impl {

// The lowest, median and highest of (value, rank) pairs; extremes on ties name the lowest rank.
COHORT_COLD inline straggler_spread spread_of(std::vector<std::pair<double, int>> values) {
  straggler_spread result;
  if (values.empty()) return result;
  std::sort(values.begin(), values.end());
  result.min = values.front().first;
  result.min_rank = values.front().second;
  result.max = values.back().first;
  result.max_rank = values.back().second;
  for (auto it = values.rbegin(); it != values.rend() && it->first == result.max; ++it) result.max_rank = it->second;
  const std::size_t n = values.size();
  result.median = n % 2 == 1 ? values[n / 2].first : (values[n / 2 - 1].first + values[n / 2].first) / 2;
  return result;
}

COHORT_COLD inline std::string format_ms(double ms) {
  char text[32];
  std::snprintf(text, sizeof text, ms < 1 ? "%.2f" : "%.1f", ms);
  return text;
}

COHORT_COLD inline std::string format_percent(double fraction) {
  char text[32];
  std::snprintf(text, sizeof text, "%.0f%%", 100 * fraction);
  return text;
}

// The window's totals: step, reduce wait, gather wait, other wait, the longest step, step CPU
// time, CPU time in the state's waits (ns; the CPU times 0 when not measured).
constexpr std::size_t window_fields = 7;

// "w <window> <steps> <step ns> <reduce ns> <gather ns> <other ns> <max step ns> <step cpu ns>
// <wait cpu ns>": decimal, so any store and any byte order read it.
COHORT_COLD inline std::string encode_window(std::uint64_t window, std::uint64_t steps,
                                             const std::int64_t (&ns)[window_fields]) {
  // Appended piece by piece: g++ 12 at -O3 (nvcc's host pass) flags `"literal" + std::string`
  // with a false -Wrestrict (GCC bug 105329), an error under -Werror.
  std::string text = "w ";
  text += std::to_string(window);
  text += ' ';
  text += std::to_string(steps);
  for (auto value : ns) {
    text += ' ';
    text += std::to_string(value);
  }
  return text;
}

// Totals in ns (window_fields) as means per step.
COHORT_COLD inline straggler_rank_stats window_stats(int rank, std::uint64_t steps,
                                                     const std::int64_t (&ns)[window_fields]) {
  straggler_rank_stats stats;
  stats.rank = rank;
  stats.steps = steps;
  const double per_step = steps > 0 ? 1e-6 / static_cast<double>(steps) : 0.0;
  stats.step_ms = static_cast<double>(ns[0]) * per_step;
  stats.reduce_wait_ms = static_cast<double>(ns[1]) * per_step;
  stats.gather_wait_ms = static_cast<double>(ns[2]) * per_step;
  stats.other_wait_ms = static_cast<double>(ns[3]) * per_step;
  stats.max_step_ms = static_cast<double>(ns[4]) * 1e-6;
  stats.compute_cpu_ms = static_cast<double>(std::max<std::int64_t>(ns[5] - ns[6], 0)) * per_step;
  return stats;
}

// False for anything but window `window` of at least one step in encode_window's form.
COHORT_COLD inline bool decode_window(const std::string& text, std::uint64_t window, int rank,
                                      straggler_rank_stats& stats) {
  if (text.size() < 2 || text[0] != 'w' || text[1] != ' ') return false;
  const char* at = text.data() + 2;
  const char* const end = text.data() + text.size();
  const auto next = [&](auto& value) {
    const auto parsed = std::from_chars(at, end, value);
    if (parsed.ec != std::errc() || (parsed.ptr != end && *parsed.ptr != ' ')) return false;
    at = parsed.ptr == end ? end : parsed.ptr + 1;
    return true;
  };
  std::uint64_t index = 0, steps = 0;
  std::int64_t ns[window_fields] = {};
  if (!next(index) || !next(steps)) return false;
  for (auto& value : ns)
    if (!next(value)) return false;
  if (index != window || steps == 0 || at != end) return false;
  stats = window_stats(rank, steps, ns);
  return true;
}

}  // namespace detail::straggler_impl

COHORT_COLD_BODY const straggler_rank_stats* straggler_summary::find(int rank) const noexcept {
  for (const auto& stats : ranks)
    if (stats.rank == rank) return &stats;
  return nullptr;
}

COHORT_COLD_BODY straggler_summary summarize_stragglers(std::uint64_t first_step, std::uint64_t last_step, int world,
                                                        std::vector<straggler_rank_stats> ranks,
                                                        std::vector<int> missing) {
  straggler_summary summary;
  summary.first_step = first_step;
  summary.last_step = last_step;
  summary.world = world;
  std::sort(ranks.begin(), ranks.end(), [](const auto& a, const auto& b) { return a.rank < b.rank; });
  std::sort(missing.begin(), missing.end());
  summary.ranks = std::move(ranks);
  summary.missing = std::move(missing);
  std::vector<std::pair<double, int>> step, compute, compute_cpu, wait, exposed;
  for (const auto& stats : summary.ranks) {
    step.emplace_back(stats.step_ms, stats.rank);
    compute.emplace_back(stats.compute_ms(), stats.rank);
    compute_cpu.emplace_back(stats.compute_cpu_ms, stats.rank);
    wait.emplace_back(stats.wait_ms(), stats.rank);
    exposed.emplace_back(stats.exposed(), stats.rank);
  }
  summary.step = detail::straggler_impl::spread_of(std::move(step));
  summary.compute = detail::straggler_impl::spread_of(std::move(compute));
  summary.compute_cpu = detail::straggler_impl::spread_of(std::move(compute_cpu));
  summary.wait = detail::straggler_impl::spread_of(std::move(wait));
  summary.exposed = detail::straggler_impl::spread_of(std::move(exposed));
  summary.slowest = summary.compute.max_rank;
  summary.slowest_over_median_ms = summary.compute.max - summary.compute.median;
  summary.balanced = summary.slowest_over_median_ms <= straggler_balance_tolerance * summary.compute.median;
  return summary;
}

COHORT_COLD_BODY std::string format_straggler_report(const straggler_summary& s) {
  using detail::straggler_impl::format_ms;
  using detail::straggler_impl::format_percent;
  std::string line = "cohort straggler report, ";
  line += s.first_step == s.last_step
              ? detail::text("step ", std::to_string(s.first_step))
              : detail::text("steps ", std::to_string(s.first_step), "-", std::to_string(s.last_step));
  const auto reported = static_cast<int>(s.ranks.size());
  line += detail::text(", ", (reported == s.world ? std::string() : detail::text(std::to_string(reported), " of ")),
                       std::to_string(s.world), (s.world == 1 ? " rank: " : " ranks: "));
  if (s.ranks.empty()) {
    line += "no rank reported";
  } else {
    const auto rank_of = [](int r) { return detail::text(" (rank ", std::to_string(r), ")"); };
    line += detail::text("step ", format_ms(s.step.median), " ms");
    line += detail::text("; compute min ", format_ms(s.compute.min), rank_of(s.compute.min_rank), ", median ",
                         format_ms(s.compute.median), ", max ", format_ms(s.compute.max), rank_of(s.compute.max_rank),
                         " ms");
    line += detail::text("; waiting in step/gathers min ", format_ms(s.wait.min), rank_of(s.wait.min_rank), ", median ",
                         format_ms(s.wait.median), ", max ", format_ms(s.wait.max), rank_of(s.wait.max_rank), " ms");
    line += detail::text("; exposed communication ", format_percent(s.exposed.min), "..", format_percent(s.exposed.max),
                         " of the step (median ", format_percent(s.exposed.median), ")");
    const std::string margin = detail::text(format_ms(s.slowest_over_median_ms), " ms/step");
    if (s.balanced) {
      const double share = s.compute.median > 0 ? s.slowest_over_median_ms / s.compute.median : 0.0;
      line += detail::text("; balanced: the slowest, rank ", std::to_string(s.slowest), ", computes +", margin, " (",
                           format_percent(share), ") over the median");
    } else {
      line += detail::text("; slowest: rank ", std::to_string(s.slowest), ", +", margin, " of compute over the median");
    }
  }
  if (!s.missing.empty())
    line += detail::text("; no report from ", detail::format_ranks(s.missing), " within ",
                         detail::format_duration(s.timeout));
  if (s.host_clock_only)
    line +=
        "; host clock only: on a device backend step() and gathers do not block the host, so waits read near 0 "
        "and compute is the whole step";
  return line;
}

// ---- the report -----------------------------------------------------------------------------

COHORT_COLD_BODY straggler_report::straggler_report(std::shared_ptr<store> exchange, int rank, int world,
                                                    straggler_options options)
    : step_boundary_(&straggler_report::step_boundary),
      store_(std::move(exchange)),
      rank_(rank),
      world_(world),
      options_(std::move(options)),
      every_(options_.every) {
  if (!store_) throw error(rank, "straggler_report", "no store", "pass the group (or a store every rank shares)");
  if (world < 1 || rank < 0 || rank >= world)
    throw error(rank, "straggler_report",
                detail::text("rank ", std::to_string(rank), " is outside a world of ", std::to_string(world)),
                "pass the group's rank and size");
  // Numbered on every rank, on or off, so the n-th reports of all ranks pair up.
  id_ = store_->add(detail::text("straggler/reports/", std::to_string(rank)), 1);
  if (rank_ == 0 && every_ > 0 && options_.slowdown) slowdown_.emplace(*options_.slowdown);
}

COHORT_COLD_BODY std::string straggler_report::key(std::uint64_t window, int rank) const {
  return detail::text("straggler/", std::to_string(id_), "/", std::to_string(window), "/", std::to_string(rank));
}

COHORT_COLD_BODY std::chrono::milliseconds straggler_report::exchange_timeout() const {
  return options_.timeout.count() > 0 ? options_.timeout : store_->timeout();
}

COHORT_COLD_BODY std::int64_t straggler_report::thread_cpu_ns() noexcept {
  timespec now{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<std::int64_t>(now.tv_sec) * 1000000000 + now.tv_nsec;
}

COHORT_COLD_BODY void straggler_report::step_boundary(clock::time_point now) {
  if (!enabled() || stopped_) return;
  ++boundaries_;
  const std::int64_t cpu = times_cpu() ? thread_cpu_ns() : 0;
  if (boundaries_ == 1) {  // step 1 is not measured: the clock starts here
    last_boundary_ = now;
    last_boundary_cpu_ns_ = cpu;
    wait_cpu_ns_ = 0;
    window_first_step_ = 2;
    for (auto& waited : waits_) waited.store(0, std::memory_order_relaxed);
    return;
  }
  window_step_cpu_ns_ += cpu - last_boundary_cpu_ns_;
  last_boundary_cpu_ns_ = cpu;
  const std::int64_t step = std::chrono::duration_cast<std::chrono::nanoseconds>(now - last_boundary_).count();
  last_boundary_ = now;
  ++window_steps_;
  window_step_ns_ += step;
  window_max_step_ns_ = std::max(window_max_step_ns_, step);
  if (boundaries_ % every_ == 0) publish(now);
  if (!pending_.empty()) collect(false);
}

COHORT_COLD_BODY void straggler_report::flush() {
  if (!enabled() || stopped_) return;
  if (boundaries_ >= 2 && window_steps_ > 0) publish(clock::now());
  if (!pending_.empty()) collect(true);
}

COHORT_COLD_BODY void straggler_report::publish(clock::time_point now) {
  std::int64_t ns[detail::straggler_impl::window_fields] = {
      window_step_ns_, 0, 0, 0, window_max_step_ns_, window_step_cpu_ns_, std::exchange(wait_cpu_ns_, 0)};
  for (std::size_t k = 0; k < 3; ++k) ns[1 + k] = waits_[k].exchange(0, std::memory_order_relaxed);
  const std::uint64_t window = ++published_;  // the same on every rank that ran the same steps
  pending_window entry;
  entry.index = window;
  entry.first_step = window_first_step_;
  entry.last_step = boundaries_;
  entry.deadline = now + exchange_timeout();
  entry.own = detail::straggler_impl::window_stats(rank_, window_steps_, ns);
  last_window_ = entry.own;
  window_first_step_ = boundaries_ + 1;
  window_steps_ = 0;
  window_step_ns_ = 0;
  window_max_step_ns_ = 0;
  window_step_cpu_ns_ = 0;
  if (rank_ == 0) {
    pending_.push_back(std::move(entry));
    return;
  }
  try {
    store_->set(key(window, rank_), detail::straggler_impl::encode_window(window, entry.own.steps, ns));
  } catch (const std::exception& failure) {
    stop(detail::text("publishing steps ", std::to_string(entry.first_step), "-", std::to_string(entry.last_step), ": ",
                      failure.what()));
  }
}

COHORT_COLD_BODY void straggler_report::collect(bool blocking) {
  struct ready {
    pending_window window;
    std::vector<straggler_rank_stats> ranks;
    std::vector<int> missing;
  };
  std::vector<ready> done;
  try {
    while (!pending_.empty()) {
      const pending_window& window = pending_.front();
      std::vector<std::string> keys;
      for (int r = 1; r < world_; ++r) keys.push_back(key(window.index, r));
      bool complete = keys.empty() || store_->check(keys);
      // Polls rather than a blocking store wait: a TCP store client holds its connection
      // for a whole wait, and the group's engine may need the same handle meanwhile.
      for (auto pause = std::chrono::milliseconds(1); !complete && blocking && clock::now() < window.deadline;) {
        std::this_thread::sleep_for(std::min<clock::duration>(pause, window.deadline - clock::now()));
        pause = std::min(2 * pause, std::chrono::milliseconds(16));
        complete = store_->check(keys);
      }
      if (!complete && clock::now() < window.deadline) break;  // not blocking: the next boundary looks again
      ready entry{window, {window.own}, {}};
      for (int r = 1; r < world_; ++r) {
        const std::string& name = keys[static_cast<std::size_t>(r - 1)];
        straggler_rank_stats stats;
        if ((complete || store_->check(std::span<const std::string>(&name, 1))) &&
            detail::straggler_impl::decode_window(to_string(store_->get(name, exchange_timeout())), window.index, r,
                                                  stats))
          entry.ranks.push_back(stats);
        else
          entry.missing.push_back(r);
        store_->delete_key(name);
      }
      done.push_back(std::move(entry));
      pending_.erase(pending_.begin());
    }
  } catch (const std::exception& failure) {
    stop(detail::text("collecting the ranks' reports: ", failure.what()));
  }
  for (auto& entry : done) report(entry.window, std::move(entry.ranks), std::move(entry.missing));
}

COHORT_COLD_BODY void straggler_report::report(const pending_window& window, std::vector<straggler_rank_stats> ranks,
                                               std::vector<int> missing) {
  auto summary =
      summarize_stragglers(window.first_step, window.last_step, world_, std::move(ranks), std::move(missing));
  summary.timeout = exchange_timeout();
  summary.host_clock_only = host_clock_only_;
  latest_ = summary;
  if (run_totals_.empty()) {
    run_totals_.resize(static_cast<std::size_t>(world_));
    run_first_step_ = summary.first_step;
  }
  for (const auto& r : summary.ranks) {
    auto& total = run_totals_[static_cast<std::size_t>(r.rank)];
    const double steps = static_cast<double>(r.steps);
    total.rank = r.rank;
    total.steps += r.steps;
    total.step_ms += r.step_ms * steps;
    total.reduce_wait_ms += r.reduce_wait_ms * steps;
    total.gather_wait_ms += r.gather_wait_ms * steps;
    total.other_wait_ms += r.other_wait_ms * steps;
    total.max_step_ms = std::max(total.max_step_ms, r.max_step_ms);
    total.compute_cpu_ms += r.compute_cpu_ms * steps;
  }
  if (options_.output) {
    const std::string line = detail::text(format_straggler_report(summary), "\n");
    std::fputs(line.c_str(), options_.output);
    std::fflush(options_.output);
  }
  if (options_.on_report) options_.on_report(*latest_);
  if (!slowdown_) return;
  const auto finding = slowdown_->observe(*latest_);
  if (!finding) return;
  if (options_.slowdown_output) {
    const std::string line = detail::text(finding->line, "\n");
    std::fputs(line.c_str(), options_.slowdown_output);
    std::fflush(options_.slowdown_output);
  }
  if (options_.slowdown_timeline)
    options_.slowdown_timeline->keep(finding->first_step, finding->last_step, finding->line);
  if (options_.on_slowdown) options_.on_slowdown(*finding);
}

COHORT_COLD_BODY std::optional<straggler_summary> straggler_report::run_summary() const {
  if (run_totals_.empty() || !latest_) return std::nullopt;
  std::vector<straggler_rank_stats> ranks;
  std::vector<int> missing;
  for (std::size_t r = 0; r < run_totals_.size(); ++r) {
    auto mean = run_totals_[r];
    if (mean.steps == 0) {
      missing.push_back(static_cast<int>(r));
      continue;
    }
    const double steps = static_cast<double>(mean.steps);
    mean.step_ms /= steps;
    mean.reduce_wait_ms /= steps;
    mean.gather_wait_ms /= steps;
    mean.other_wait_ms /= steps;
    mean.compute_cpu_ms /= steps;
    ranks.push_back(mean);
  }
  auto run = summarize_stragglers(run_first_step_, latest_->last_step, world_, std::move(ranks), std::move(missing));
  run.host_clock_only = host_clock_only_;
  return run;
}

COHORT_COLD_BODY scaling_verdict scaling_verdict_of(const straggler_summary& run) {
  scaling_verdict verdict;
  verdict.world = run.world;
  verdict.step_ms = run.step.median;
  verdict.exposed = run.exposed.median;
  verdict.from_cpu_time = run.compute_cpu.median > 0;
  verdict.one_rank_step_ms = (verdict.from_cpu_time ? run.compute_cpu.median : run.compute.median) * run.world;
  verdict.speedup = verdict.step_ms > 0 ? verdict.one_rank_step_ms / verdict.step_ms : 0.0;
  verdict.slowest = run.balanced ? -1 : run.slowest;
  verdict.slowest_over_median_ms = run.slowest_over_median_ms;
  if (verdict.slowest >= 0 && verdict.slowest_over_median_ms > 0.2 * verdict.step_ms)
    verdict.advice = detail::text("rank ", std::to_string(verdict.slowest),
                                  " holds the others up: look at its host, its data or its share of the work");
  else if (verdict.exposed > 0.3)
    verdict.advice =
        "communication is exposed: try more accumulation (no_sync micro-steps), larger buckets, or ddp instead of "
        "zero3 where the memory allows";
  return verdict;
}

COHORT_COLD_BODY std::string format_scaling_verdict(const scaling_verdict& v) {
  char text[600];
  std::snprintf(text, sizeof text,
                "cohort verdict, %d rank%s: step %.2f ms, communication exposed %.0f%% of the step; %s; %s "
                "%.2fx one rank's throughput (one rank's step estimated at %.2f ms: %d x the median "
                "compute%s)%s%s",
                v.world, v.world == 1 ? "" : "s", v.step_ms, 100 * v.exposed,
                v.slowest >= 0 ? detail::text("slowest rank ", std::to_string(v.slowest), ", +",
                                              detail::straggler_impl::format_ms(v.slowest_over_median_ms),
                                              " ms/step of compute over the median")
                                     .c_str()
                               : "the ranks balanced",
                v.world == 1 ? "it delivers" : "they deliver", v.speedup, v.one_rank_step_ms, v.world,
                v.from_cpu_time ? "'s CPU time" : "", v.advice.empty() ? "" : "; ", v.advice.c_str());
  return text;
}

COHORT_COLD_BODY std::optional<slowdown_finding> slowdown_watch::observe(const straggler_summary& window) {
  if (!window.missing.empty() || window.ranks.empty()) return std::nullopt;
  const double lead = window.slowest_over_median_ms;
  if (!has_baseline()) {
    const double n = static_cast<double>(baseline_count_);
    baseline_step_ms_ = n == 0 ? window.step.median : std::min(baseline_step_ms_, window.step.median);
    baseline_exposed_ = (baseline_exposed_ * n + window.exposed.median) / (n + 1);
    baseline_lead_ms_ = (baseline_lead_ms_ * n + lead) / (n + 1);
    ++baseline_count_;
    return std::nullopt;
  }
  // One rank alone: it computes longer than the median rank by more than it did, and that
  // explains at least half of the step's rise (the others wait for it). Else every rank alike:
  // the median step, or the median exposed share, moved past the threshold.
  const double margin = std::max(options_.threshold * baseline_step_ms_, options_.min_ms);
  const double step_rise = window.step.median - baseline_step_ms_;
  const double lead_rise = lead - baseline_lead_ms_;
  int cause = -2;
  if (window.world > 1 && window.slowest >= 0 && lead_rise > margin && lead_rise >= 0.5 * step_rise)
    cause = window.slowest;
  else if (step_rise > std::max(options_.every_rank_threshold * baseline_step_ms_, options_.min_ms) ||
           window.exposed.median - baseline_exposed_ > options_.exposed_threshold)
    cause = -1;
  if (cause == -2) {
    candidate_ = reported_ = -2;
    candidate_windows_ = 0;
    return std::nullopt;
  }
  if (cause != candidate_) {
    candidate_ = cause;
    candidate_windows_ = 0;
    candidate_first_ = window.first_step;
  }
  if (++candidate_windows_ < options_.sustained || cause == reported_) return std::nullopt;
  reported_ = cause;
  slowdown_finding finding;
  finding.rank = cause;
  finding.first_step = candidate_first_;
  finding.last_step = window.last_step;
  char text[400];
  if (cause >= 0) {
    const auto* slowed = window.find(cause);
    std::snprintf(text, sizeof text,
                  "cohort slowdown: rank %d slowed since step %llu: it computes %.1f ms/step more than the median "
                  "rank (baseline %+.1f); step %.1f -> %.1f ms (steps %llu-%llu)",
                  cause, static_cast<unsigned long long>(candidate_first_), lead, baseline_lead_ms_, baseline_step_ms_,
                  slowed ? slowed->step_ms : window.step.median, static_cast<unsigned long long>(window.first_step),
                  static_cast<unsigned long long>(window.last_step));
  } else {
    std::snprintf(text, sizeof text,
                  "cohort slowdown: every rank alike since step %llu (no single rank): step %.1f -> %.1f ms, "
                  "exposed communication %.0f%% -> %.0f%% (steps %llu-%llu)",
                  static_cast<unsigned long long>(candidate_first_), baseline_step_ms_, window.step.median,
                  100 * baseline_exposed_, 100 * window.exposed.median,
                  static_cast<unsigned long long>(window.first_step),
                  static_cast<unsigned long long>(window.last_step));
  }
  finding.line = text;
  return finding;
}

COHORT_COLD_BODY void straggler_report::stop(const std::string& what) {
  stopped_ = true;
  pending_.clear();
  failure_ = what;
  if (options_.output) {
    const std::string line =
        detail::text("cohort straggler report: rank ", std::to_string(rank_), " stops reporting: ", what, "\n");
    std::fputs(line.c_str(), options_.output);
    std::fflush(options_.output);
  }
}

}  // namespace cohort::inline v0
