// straggler_report: the statistics on constructed numbers, and on Gloo ranks as threads a rank
// slowed in its backward (or before a gather) named slowest, the others' waits larger; late
// and absent ranks handled within the timeout.
#include <catch2/catch.hpp>

#include <cohort/comm/gloo.hpp>
#include <cohort/diagnostics/straggler.hpp>
#include <cohort/parallel/training_state.hpp>
#include <cohort/rendezvous/store.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "support.hpp"

namespace {

using group = cohort::process_group<cohort::gloo>;
using namespace std::chrono_literals;

group make_group(const std::shared_ptr<cohort::memory_store>& store, int rank, int world) {
  cohort::gloo::options options;
  options.timeout = std::chrono::seconds(5);
  return group(store, cohort::launch_env::explicit_ranks(rank, world), options);
}

cohort::straggler_rank_stats stats(int rank, double step, double reduce, double gather = 0) {
  cohort::straggler_rank_stats s;
  s.rank = rank;
  s.steps = 100;
  s.step_ms = step;
  s.reduce_wait_ms = reduce;
  s.gather_wait_ms = gather;
  s.max_step_ms = step;
  return s;
}

// What a FILE* received (a tmpfile per rank).
std::string contents(std::FILE* file) {
  std::fflush(file);
  std::rewind(file);
  std::string text;
  char chunk[512];
  while (const std::size_t n = std::fread(chunk, 1, sizeof chunk, file)) text.append(chunk, n);
  return text;
}

std::size_t count_of(const std::string& text, const std::string& needle) {
  std::size_t count = 0;
  for (auto at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++count;
  return count;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

// ---- the statistics -------------------------------------------------------------------------

TEST_CASE("summarize_stragglers: min, median, max, exposed share and the slowest rank", "[straggler]") {
  // Compute = step - wait: 10 (rank 0), 10.6 (rank 1), 34 (rank 2), 10 (rank 3).
  const auto s = cohort::summarize_stragglers(
      101, 200, 4, {stats(3, 40, 30), stats(2, 40, 6), stats(0, 40, 28, 2), stats(1, 40, 29.4)});
  REQUIRE(s.ranks.size() == 4);
  CHECK(s.ranks[0].rank == 0);  // sorted by rank
  CHECK(s.ranks[3].rank == 3);
  CHECK(s.compute.min == Approx(10));
  CHECK(s.compute.min_rank == 0);           // tie with rank 3: the lower rank
  CHECK(s.compute.median == Approx(10.3));  // even count: mean of 10 and 10.6
  CHECK(s.compute.max == Approx(34));
  CHECK(s.compute.max_rank == 2);
  CHECK(s.wait.min == Approx(6));
  CHECK(s.wait.min_rank == 2);
  CHECK(s.wait.median == Approx(29.7));
  CHECK(s.wait.max == Approx(30));
  CHECK(s.wait.max_rank == 0);  // rank 0 (28 + 2) ties rank 3
  CHECK(s.exposed.min == Approx(0.15));
  CHECK(s.exposed.max == Approx(0.75));
  CHECK(s.exposed.median == Approx((29.4 / 40 + 0.75) / 2));
  CHECK(s.step.median == Approx(40));
  CHECK(s.slowest == 2);
  CHECK(s.slowest_over_median_ms == Approx(23.7));
  CHECK_FALSE(s.balanced);
  CHECK(s.find(2)->compute_ms() == Approx(34));
  CHECK(s.find(7) == nullptr);

  const auto line = cohort::format_straggler_report(s);
  INFO(line);
  CHECK(line.find("cohort straggler report, steps 101-200, 4 ranks: step 40.0 ms") == 0);
  CHECK(line.find("compute min 10.0 (rank 0), median 10.3, max 34.0 (rank 2) ms") != std::string::npos);
  CHECK(line.find("waiting in step/gathers min 6.0 (rank 2), median 29.7, max 30.0 (rank 0) ms") != std::string::npos);
  CHECK(line.find("exposed communication 15%..75% of the step (median 74%)") != std::string::npos);
  CHECK(line.find("slowest: rank 2, +23.7 ms/step of compute over the median") != std::string::npos);
  CHECK(line.find('\n') == std::string::npos);
}

TEST_CASE("summarize_stragglers: odd counts, balanced ranks, missing ranks, clamping", "[straggler]") {
  SECTION("three ranks within 5% of the median are balanced") {
    auto s = cohort::summarize_stragglers(2, 100, 3, {stats(0, 20, 10), stats(1, 20, 9.8), stats(2, 20, 9.6)});
    CHECK(s.compute.median == Approx(10.2));  // odd count: the middle value
    CHECK(s.slowest == 2);
    CHECK(s.slowest_over_median_ms == Approx(0.2));
    CHECK(s.balanced);
    const auto line = cohort::format_straggler_report(s);
    CHECK(line.find("balanced: the slowest, rank 2, computes +0.20 ms/step (2%) over the median") != std::string::npos);
  }
  SECTION("a rank that did not report is named, with the wait") {
    auto s = cohort::summarize_stragglers(7, 7, 4, {stats(0, 20, 10), stats(2, 20, 2), stats(1, 20, 11)}, {3});
    s.timeout = 2s;
    CHECK(s.missing == std::vector<int>{3});
    CHECK(s.slowest == 2);
    const auto line = cohort::format_straggler_report(s);
    CHECK(line.find("step 7, 3 of 4 ranks:") != std::string::npos);
    CHECK(line.find("no report from rank 3 within 2 s") != std::string::npos);
  }
  SECTION("no rank at all") {
    const auto s = cohort::summarize_stragglers(2, 10, 2, {}, {0, 1});
    CHECK(s.slowest == -1);
    CHECK(cohort::format_straggler_report(s).find("no rank reported") != std::string::npos);
  }
  SECTION("waits longer than the step (another thread's gathers) clamp compute to 0, exposed to 1") {
    const auto r = stats(0, 10, 8, 4);
    CHECK(r.compute_ms() == 0);
    CHECK(r.exposed() == 1);
  }
  SECTION("a device backend's line says what its clock measures") {
    auto s = cohort::summarize_stragglers(2, 10, 1, {stats(0, 10, 0.1)});
    s.host_clock_only = true;
    CHECK(cohort::format_straggler_report(s).find("host clock only") != std::string::npos);
  }
}

// ---- measurement on one rank ------------------------------------------------------------------

TEST_CASE("straggler_report measures steps and waits, and skips the first step", "[straggler]") {
  struct slow_work {
    void wait() const { std::this_thread::sleep_for(10ms); }
  };
  std::vector<cohort::straggler_summary> reports;
  cohort::straggler_report report(
      std::make_shared<cohort::memory_store>(), 0, 1,
      {.every = 4, .output = nullptr, .on_report = [&](const cohort::straggler_summary& s) { reports.push_back(s); }});
  std::this_thread::sleep_for(50ms);  // before the first boundary: not measured
  report.end_step();
  for (int step = 2; step <= 8; ++step) {
    std::this_thread::sleep_for(5ms);
    report.wait(slow_work{});
    report.end_step();
  }
  REQUIRE(reports.size() == 2);  // steps 2-4 and 5-8; world 1 reports at once
  CHECK(reports[0].first_step == 2);
  CHECK(reports[0].last_step == 4);
  CHECK(reports[0].ranks[0].steps == 3);
  CHECK(reports[1].first_step == 5);
  CHECK(reports[1].last_step == 8);
  const auto& own = reports[1].ranks[0];
  CHECK(own.steps == 4);
  CHECK(own.other_wait_ms >= 9.5);
  CHECK(own.other_wait_ms < 40);
  CHECK(own.reduce_wait_ms == 0);
  CHECK(own.step_ms >= own.other_wait_ms + 4.5);
  CHECK(own.max_step_ms < 50);  // the 50 ms before step 1 is in no window
  CHECK(own.exposed() > 0.3);
  report.flush();  // nothing since step 8
  CHECK(reports.size() == 2);
  CHECK(report.steps() == 8);
}

TEST_CASE("with cpu_time_compute the verdict counts compute in CPU time, not the time others took", "[straggler]") {
  // Each step computes 3 ms of CPU time and is kept off the core 10 ms more (a sleep, as a
  // rank waits for a core it shares): wall-clock compute 13 ms, CPU time 3.
  const auto step = [] {
    std::this_thread::sleep_for(10ms);
    const std::int64_t began = cohort::straggler_report::thread_cpu_ns();
    while (cohort::straggler_report::thread_cpu_ns() - began < 3'000'000) {}
  };
  for (const bool cpu_time : {false, true}) {
    INFO("cpu_time_compute " << cpu_time);
    cohort::straggler_report report(std::make_shared<cohort::memory_store>(), 0, 1,
                                    {.every = 4, .output = nullptr, .cpu_time_compute = cpu_time});
    CHECK(report.times_cpu() == cpu_time);
    report.end_step();
    for (int s = 2; s <= 9; ++s) {
      step();
      report.end_step();
    }
    const auto run = report.run_summary();
    REQUIRE(run);
    CHECK(run->compute.median >= 12.5);
    const auto verdict = cohort::scaling_verdict_of(*run);
    CHECK(verdict.from_cpu_time == cpu_time);
    if (cpu_time) {
      CHECK(run->compute_cpu.median >= 2.9);
      CHECK(run->compute_cpu.median < 8);
      CHECK(verdict.one_rank_step_ms == Approx(run->compute_cpu.median));
      CHECK(cohort::format_scaling_verdict(verdict).find("1 x the median compute's CPU time") != std::string::npos);
    } else {
      CHECK(run->compute_cpu.median == 0);
      CHECK(verdict.one_rank_step_ms == Approx(run->compute.median));
    }
  }
}

TEST_CASE("straggler_report with every = 0 is off", "[straggler]") {
  cohort::straggler_report report(std::make_shared<cohort::memory_store>(), 0, 1, {.every = 0, .output = nullptr});
  for (int step = 0; step < 5; ++step) report.end_step();
  report.flush();
  CHECK_FALSE(report.enabled());
  CHECK(report.steps() == 0);
  CHECK_FALSE(report.latest());
}

// ---- real ranks -------------------------------------------------------------------------------

TEST_CASE("the straggler report names the rank slowed in its backward (3 Gloo ranks)", "[straggler][gloo]") {
  constexpr int world = 3;
  constexpr int slow = 2;
  constexpr int steps = 9;  // step 1 unmeasured, windows 2-4 and 5-8, then step 9 (flush)
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::FILE*> outputs;
  for (int r = 0; r < world; ++r) outputs.push_back(std::tmpfile());
  std::vector<cohort::straggler_summary> reports;  // rank 0's thread only
  std::vector<std::uint64_t> collected_at;
  const auto start = std::chrono::steady_clock::now();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world);
    cohort::straggler_report* self = nullptr;
    cohort::straggler_report report(pg, {.every = 4,
                                         .output = outputs[static_cast<std::size_t>(rank)],
                                         .on_report = [&](const cohort::straggler_summary& s) {
                                           reports.push_back(s);
                                           collected_at.push_back(self->steps());
                                         }});
    self = &report;
    // Three layers of 4096, 256 and 64 floats: two buckets of at most 4 KiB under ddp, and
    // plain SGD at lr 1 from zero, so the parameters are minus the sum of the averaged gradients.
    const std::vector<cohort::region> regions{{"a", 0, 4096, 0}, {"b", 4096, 256, 1}, {"c", 4352, 64, 2}};
    cohort::training_state<cohort::gloo> state{
        pg, regions, {.bucket_bytes = 4096, .sgd = cohort::sgd_options{.lr = 1}, .straggler = &report}};
    RANK_CHECK(state.bucket_count() >= 2);
    state.load_parameters(std::vector<float>(4416, 0.0f));
    float expected = 0;
    for (int step = 1; step <= steps; ++step) {
      // The backward: the slow rank takes 30 ms longer before its gradients are ready.
      if (rank == slow) std::this_thread::sleep_for(30ms);
      for (std::size_t i = regions.size(); i-- > 0;) {
        for (auto& g : state.gradient(i)) g = static_cast<float>(rank + step);
        state.mark_ready(i);
      }
      state.step();
      expected -= static_cast<float>(1 + step);  // (0 + 1 + 2) / 3 + step
      const auto layer = state.gather(0);
      RANK_CHECK(std::abs(layer.param(0)[0] - expected) < 1e-5f * std::abs(expected));
    }
    report.flush();
    RANK_CHECK(report.failure().empty(), report.failure());
    RANK_CHECK(report.steps() == steps);
    RANK_CHECK(report.last_window().steps == 1);  // step 9, from flush
    RANK_CHECK(static_cast<bool>(report.latest()) == (rank == 0));
  });
  const double wall = seconds_since(start);
  INFO("wall " << wall << " s");
  CHECK(wall < 5);

  REQUIRE(reports.size() == 3);
  CHECK(reports[0].first_step == 2);
  CHECK(reports[0].last_step == 4);
  CHECK(reports[1].first_step == 5);
  CHECK(reports[1].last_step == 8);
  CHECK(reports[2].first_step == 9);
  CHECK(reports[2].last_step == 9);
  // The first window was collected at a later step boundary, without blocking, before flush.
  CHECK(collected_at[0] < steps);
  for (const auto& s : reports) {
    const auto line = cohort::format_straggler_report(s);
    INFO(line);
    REQUIRE(s.ranks.size() == world);
    CHECK(s.missing.empty());
    CHECK(s.slowest == slow);
    CHECK_FALSE(s.balanced);
    const auto& slowed = *s.find(slow);
    CHECK(slowed.compute_ms() >= 25);
    for (int r = 0; r < world; ++r) {
      if (r == slow) continue;
      const auto& other = *s.find(r);
      // The others wait in step() for the slowed rank's buckets.
      CHECK(other.reduce_wait_ms >= 20);
      CHECK(other.wait_ms() > slowed.wait_ms() + 15);
      CHECK(slowed.compute_ms() > other.compute_ms() + 15);
      CHECK(other.exposed() > 0.5);
      CHECK(other.gather_wait_ms == 0);
    }
    CHECK(s.wait.min_rank == slow);
    CHECK(line.find("slowest: rank 2,") != std::string::npos);
  }
  // Printed on the main rank only: one line per window.
  const auto printed = contents(outputs[0]);
  INFO(printed);
  CHECK(count_of(printed, "cohort straggler report, ") == 3);
  CHECK(count_of(printed, "slowest: rank 2,") == 3);
  CHECK(contents(outputs[1]).empty());
  CHECK(contents(outputs[2]).empty());
  for (auto* file : outputs) std::fclose(file);
}

TEST_CASE("the straggler report counts waits in zero3 gathers (2 Gloo ranks)", "[straggler][gloo]") {
  constexpr int world = 2;
  constexpr int slow = 1;
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<cohort::straggler_summary> reports;
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world);
    cohort::straggler_report report(
        pg, {.every = 3, .output = nullptr, .on_report = [&](const cohort::straggler_summary& s) {
               reports.push_back(s);
             }});
    // No prefetch: each layer is gathered when the forward reaches it.
    const std::vector<cohort::region> regions{{"w", 0, 300, 0}, {"b", 300, 20, 0}, {"v", 320, 200, 1}};
    cohort::training_state<cohort::gloo> state{
        pg, regions, {.strategy = cohort::strategy::zero3, .prefetch = 0, .straggler = &report}};
    state.load_parameters(std::vector<float>(520, 0.0f));
    float sink = 0;
    for (int step = 1; step <= 7; ++step) {
      {
        auto layer = state.gather(0);
        sink += layer.param(0)[0];
      }
      // The slow rank's forward through layer 0 takes 25 ms longer: the other waits in the
      // next gather.
      if (rank == slow) std::this_thread::sleep_for(25ms);
      {
        auto layer = state.gather(1);
        sink += layer.param(2)[0];
      }
      (void)state.step();  // zero gradients: nothing moves; the step ends the report's step
    }
    report.flush();
    RANK_CHECK(sink == 0);
    RANK_CHECK(report.failure().empty(), report.failure());
  });
  REQUIRE(reports.size() == 3);  // steps 2-3, 4-6, 7
  for (const auto& s : reports) {
    INFO(cohort::format_straggler_report(s));
    REQUIRE(s.ranks.size() == world);
    CHECK(s.slowest == slow);
    CHECK(s.find(0)->gather_wait_ms >= 15);
    CHECK(s.find(0)->gather_wait_ms > s.find(slow)->gather_wait_ms + 10);
  }
}

TEST_CASE("a rank that reaches the first exchange late is still in the report", "[straggler][gloo]") {
  constexpr int world = 2;
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<cohort::straggler_summary> reports;
  double flush_seconds = 0;
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world);
    cohort::straggler_report report(pg, {.every = 3,
                                         .output = nullptr,
                                         .on_report = [&](const cohort::straggler_summary& s) { reports.push_back(s); },
                                         .timeout = 3s});
    if (rank == 1) std::this_thread::sleep_for(400ms);  // starts late; rank 0 runs ahead
    for (int step = 1; step <= 7; ++step) {
      std::this_thread::sleep_for(1ms);
      report.end_step();
    }
    const auto start = std::chrono::steady_clock::now();
    report.flush();
    if (rank == 0) flush_seconds = seconds_since(start);
    RANK_CHECK(report.failure().empty(), report.failure());
  });
  INFO("rank 0 waited " << flush_seconds << " s in flush");
  CHECK(flush_seconds > 0.2);    // it did wait for rank 1 ...
  CHECK(flush_seconds < 3);      // ... and less than the timeout
  REQUIRE(reports.size() == 3);  // steps 2-3, 4-6, 7
  for (const auto& s : reports) {
    CHECK(s.missing.empty());
    CHECK(s.ranks.size() == world);
  }
  CHECK(reports[2].first_step == 7);
}

TEST_CASE("a rank that never reports is named within the timeout, and nothing hangs", "[straggler][gloo]") {
  constexpr int world = 2;
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<cohort::straggler_summary> reports;
  std::FILE* output = std::tmpfile();
  double flush_seconds = 0;
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world);
    // Rank 1 has the report off: it publishes nothing.
    cohort::straggler_report report(pg, {.every = rank == 0 ? 2u : 0u,
                                         .output = output,
                                         .on_report = [&](const cohort::straggler_summary& s) { reports.push_back(s); },
                                         .timeout = 300ms});
    for (int step = 1; step <= 3; ++step) report.end_step();
    const auto start = std::chrono::steady_clock::now();
    report.flush();
    if (rank == 0) flush_seconds = seconds_since(start);
  });
  INFO("flush took " << flush_seconds << " s");
  CHECK(flush_seconds < 2);
  REQUIRE(reports.size() == 2);  // step 2, step 3
  for (const auto& s : reports) {
    CHECK(s.missing == std::vector<int>{1});
    CHECK(s.ranks.size() == 1);
  }
  const auto printed = contents(output);
  INFO(printed);
  CHECK(count_of(printed, "1 of 2 ranks") == 2);
  CHECK(count_of(printed, "no report from rank 1 within 300 ms") == 2);
  std::fclose(output);
}

// ---- the slowdown watch ------------------------------------------------------------------------

namespace {

// A window of 3 ranks: each computes `compute[r]` ms and waits for the slowest (a step of the
// slowest compute plus 2 ms of communication).
cohort::straggler_summary window_of(std::uint64_t index, std::vector<double> compute) {
  double slowest = 0;
  for (const double c : compute) slowest = std::max(slowest, c);
  std::vector<cohort::straggler_rank_stats> ranks;
  for (int r = 0; r < static_cast<int>(compute.size()); ++r)
    ranks.push_back(stats(r, slowest + 2, slowest + 2 - compute[static_cast<std::size_t>(r)]));
  return cohort::summarize_stragglers(4 * index + 1, 4 * index + 4, static_cast<int>(compute.size()), ranks);
}

std::vector<cohort::slowdown_finding> watch(const std::vector<std::vector<double>>& windows) {
  cohort::slowdown_watch watcher;
  std::vector<cohort::slowdown_finding> findings;
  for (std::size_t w = 0; w < windows.size(); ++w)
    if (auto finding = watcher.observe(window_of(w, windows[w]))) findings.push_back(*finding);
  return findings;
}

}  // namespace

TEST_CASE("the slowdown watch names the one rank that slowed, once, after a sustained window", "[straggler]") {
  const std::vector<double> steady{10, 10.5, 10.2}, rank1_slow{10, 50, 10.2};
  // Baseline 3 windows, 1 steady, then rank 1 slow for 4 windows.
  const auto findings = watch({steady, steady, steady, steady, rank1_slow, rank1_slow, rank1_slow, rank1_slow});
  REQUIRE(findings.size() == 1);
  INFO(findings[0].line);
  CHECK(findings[0].rank == 1);
  CHECK(findings[0].first_step == 17);  // the first slow window (index 4)
  CHECK(findings[0].last_step == 24);   // the second: sustained
  CHECK(findings[0].line.find("rank 1 slowed") != std::string::npos);
  // A single slow window is no finding; nor is a steady run.
  CHECK(watch({steady, steady, steady, rank1_slow, steady, steady}).empty());
  CHECK(watch({steady, steady, steady, steady, steady, steady, steady}).empty());
  // Cleared, then slow again: a second line.
  CHECK(watch({steady, steady, steady, rank1_slow, rank1_slow, steady, rank1_slow, rank1_slow}).size() == 2);
}

TEST_CASE("the slowdown watch names no rank when every rank slowed alike", "[straggler]") {
  const std::vector<double> steady{10, 10.5, 10.2}, all_slow{50, 50.5, 50.2};
  const auto findings = watch({steady, steady, steady, all_slow, all_slow, all_slow});
  REQUIRE(findings.size() == 1);
  INFO(findings[0].line);
  CHECK(findings[0].rank == -1);
  CHECK(findings[0].line.find("every rank alike") != std::string::npos);
  for (const char* named : {"rank 0", "rank 1", "rank 2"}) CHECK(findings[0].line.find(named) == std::string::npos);
}

TEST_CASE("the scaling verdict estimates one rank's step as N x the median compute", "[straggler]") {
  // 4 ranks computing 10 ms and waiting 3 (rank 3: 12 and 1): one rank would take 40 ms.
  auto run =
      cohort::summarize_stragglers(2, 41, 4, {stats(0, 13, 3), stats(1, 13, 3), stats(2, 13, 3), stats(3, 13, 1)});
  const auto verdict = cohort::scaling_verdict_of(run);
  CHECK(verdict.world == 4);
  CHECK(verdict.one_rank_step_ms == Approx(40));
  CHECK(verdict.speedup == Approx(40.0 / 13));
  CHECK(verdict.exposed == Approx(3.0 / 13));
  CHECK(verdict.slowest == 3);
  const auto line = cohort::format_scaling_verdict(verdict);
  INFO(line);
  CHECK(line.find("4 ranks: step 13.00 ms") != std::string::npos);
  CHECK(line.find("3.08x one rank's throughput") != std::string::npos);
  CHECK(line.find("slowest rank 3, +2") != std::string::npos);
}
