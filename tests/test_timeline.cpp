// timeline: the file each rank writes is Chrome trace event JSON whose spans nest in their
// step, the ring keeps the last steps, start()/stop() record a window; on Gloo ranks as threads
// the training state's waits are in it, and the merged file puts every rank's step k side by
// side (cohort-trace timeline).
#include <catch2/catch.hpp>

#include <cohort/comm/gloo.hpp>
#include <cohort/diagnostics/timeline.hpp>
#include <cohort/parallel/checkpoint.hpp>
#include <cohort/parallel/training_state.hpp>
#include <cohort/rendezvous/store.hpp>
#include <cohort/tools/detail/json.hpp>
#include <cohort/tools/timeline_merge.hpp>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support.hpp"

namespace {

namespace fs = std::filesystem;
using group = cohort::process_group<cohort::gloo>;
using cohort::detail::json;
using namespace std::chrono_literals;

struct scratch_dir {
  fs::path path;
  explicit scratch_dir(const std::string& name)
      : path(fs::temp_directory_path() / ("cohort_test_timeline_" + std::to_string(::getpid()) + "_" + name)) {
    fs::remove_all(path);
  }
  ~scratch_dir() {
    std::error_code ignored;
    fs::remove_all(path, ignored);
  }
};

json read_json(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return cohort::detail::parse_json(text.str());
}

// The trace event schema's complete events, and that spans of one pid/tid nest (each lies
// wholly inside the spans still open where it begins, or after them). Returns the X events.
std::vector<const json*> check_trace_events(const json& document) {
  std::vector<const json*> spans;
  const auto& events = document.at("traceEvents").as_array();
  REQUIRE_FALSE(events.empty());
  for (const auto& e : events) {
    REQUIRE(e.at("name").is_string());
    REQUIRE(e.at("ph").is_string());
    REQUIRE(e.at("pid").is_number());
    REQUIRE(e.at("tid").is_number());
    if (e.at("ph").as_string() == "M") continue;
    REQUIRE(e.at("ph").as_string() == "X");
    REQUIRE(e.at("cat").is_string());
    REQUIRE(e.at("ts").is_number());
    REQUIRE(e.at("dur").as_number() >= 0);
    REQUIRE(e.at("args").at("step").as_int64() >= 1);
    spans.push_back(&e);
  }
  std::map<std::pair<double, double>, std::vector<std::pair<double, double>>> by_thread;
  for (const json* e : spans)
    by_thread[{e->at("pid").as_number(), e->at("tid").as_number()}].emplace_back(
        e->at("ts").as_number(), e->at("ts").as_number() + e->at("dur").as_number());
  for (auto& [thread, intervals] : by_thread) {
    INFO("pid " << thread.first);
    CHECK(cohort::count_unnested(intervals) == 0);
  }
  return spans;
}

// Where each rank's steps end in a merged trace: rank -> "step k" -> microseconds.
std::map<std::int64_t, std::map<std::string, double>> step_ends(const json& document) {
  std::map<std::int64_t, std::map<std::string, double>> ends;
  for (const json* e : check_trace_events(document))
    if (e->at("cat").as_string() == "step")
      ends[e->at("pid").as_int64()][e->at("name").as_string()] = e->at("ts").as_number() + e->at("dur").as_number();
  return ends;
}

}  // namespace

TEST_CASE("a timeline is trace event JSON whose spans nest in their steps, the last steps kept", "[timeline]") {
  scratch_dir dir("ring");
  {
    cohort::timeline timeline(3, {.directory = dir.path.string(), .keep_steps = 4});
    REQUIRE(timeline.enabled());
    REQUIRE(timeline.recording());
    for (int step = 1; step <= 10; ++step) {
      {
        auto forward = timeline.span("forward");
        auto inner = timeline.span("layer \"0\"");  // quoted: escaped in the file
      }
      const auto now = cohort::timeline::clock::now();
      timeline.add_span("wait", cohort::timeline_category::communication, now - 1ms, now);
      timeline.end_step();
    }
    CHECK(timeline.step() == 11);
  }
  const json document = read_json(dir.path / "rank3.timeline.json");
  const auto spans = check_trace_events(document);
  CHECK(document.at("otherData").at("rank").as_int64() == 3);
  std::map<std::int64_t, int> per_step;
  for (const json* e : spans) {
    CHECK(e->at("pid").as_int64() == 3);
    ++per_step[e->at("args").at("step").as_int64()];
  }
  // Steps 7..10 kept, 4 spans each (the step, forward, its inner one, the wait).
  CHECK(per_step == std::map<std::int64_t, int>{{7, 4}, {8, 4}, {9, 4}, {10, 4}});
  // The nesting check sees a span that overlaps its neighbour.
  CHECK(cohort::count_unnested({{0, 10}, {1, 2}, {2, 3}, {9, 12}}) == 1);
  CHECK(cohort::count_unnested({{0, 10}, {1, 2}, {2, 3}, {10, 12}}) == 0);
}

TEST_CASE("a timeline records nothing without a directory, and only the window start() to stop()", "[timeline]") {
  {
    cohort::timeline off(0, {.directory = ""});
    if (!off.enabled()) {  // COHORT_TIMELINE may be set around the test
      auto nothing = off.span("forward");
      off.end_step();
      CHECK_FALSE(off.recording());
      CHECK(off.events().empty());
    }
  }
  scratch_dir dir("window");
  cohort::timeline timeline(0, {.directory = dir.path.string(), .recording = false});
  CHECK_FALSE(timeline.recording());
  for (int step = 1; step <= 8; ++step) {
    if (step == 3) timeline.start();
    if (step == 6) timeline.stop();
    { auto forward = timeline.span("forward"); }
    timeline.end_step();
  }
  std::vector<std::uint64_t> steps;
  for (const auto& e : timeline.events())
    if (e.category == cohort::timeline_category::step) steps.push_back(e.step);
  CHECK(steps == std::vector<std::uint64_t>{3, 4, 5});
}

TEST_CASE("cohort-trace timeline refuses files of two runs in one directory", "[timeline]") {
  // What a rank's timeline is made from: its place in a group.
  struct place {
    int rank_in_group, ranks;
    int rank() const { return rank_in_group; }
    int world_size() const { return ranks; }
  };
  const auto record = [](const fs::path& directory, place where) {
    cohort::timeline timeline(where, {.directory = directory.string()});
    for (int step = 1; step <= 3; ++step) {
      { auto forward = timeline.span("forward"); }
      timeline.end_step();
    }
  };
  scratch_dir dir("two_runs");
  // A run of 2 ranks, then a run of one whose rank 0 lands over the first's.
  record(dir.path, {0, 2});
  record(dir.path, {1, 2});
  CHECK(cohort::merge_timelines(dir.path).ranks.size() == 2);
  record(dir.path, {0, 1});
  CHECK_THROWS_WITH(cohort::merge_timelines(dir.path), Catch::Contains("not the ranks of one run") &&
                                                           Catch::Contains("rank 0 of 1") &&
                                                           Catch::Contains("rank 1 of 2"));
}

TEST_CASE("cohort-trace timeline aligns the ranks on their steps' ends, not on when each made its timeline",
          "[timeline]") {
  // Rank 1 makes its timeline 40 ms after rank 0 (a late thread, a slow import), then both end
  // every step together, as a collective ends it. On one clock their steps already sit side by
  // side; the merge must not move them apart by the late start.
  scratch_dir dir("late_start");
  {
    cohort::timeline early(0, {.directory = dir.path.string()});
    std::this_thread::sleep_for(40ms);
    cohort::timeline late(1, {.directory = dir.path.string()});
    auto end = cohort::timeline::clock::now();
    for (int step = 1; step <= 4; ++step) {
      end += 10ms;
      early.end_step(end);
      late.end_step(end);
    }
  }
  const auto merged = cohort::merge_timelines(dir.path);
  REQUIRE(merged.common_steps.size() == 4);
  const auto ends = step_ends(merged.document);
  for (const std::string step : {"step 1", "step 2", "step 3", "step 4"}) {
    INFO(step << ": rank 0 ends at " << ends.at(0).at(step) << " us, rank 1 at " << ends.at(1).at(step) << " us");
    CHECK(std::abs(ends.at(0).at(step) - ends.at(1).at(step)) < 2.0);  // the file's microseconds, rounded
  }
}

TEST_CASE("cohort-trace timeline aligns ranks of other clocks by the median of their steps' ends", "[timeline]") {
  // Rank 1's clock runs 5 s ahead (another host), and one of its steps ends 3 ms late (a
  // straggling rank): the merge moves it by the median difference, so every other step lines up.
  scratch_dir dir("other_clock");
  {
    cohort::timeline zero(0, {.directory = dir.path.string()});
    cohort::timeline one(1, {.directory = dir.path.string()});
    auto end = cohort::timeline::clock::now();
    for (int step = 1; step <= 5; ++step) {
      end += 10ms;
      zero.end_step(end);
      one.end_step(end + 5s + (step == 3 ? 3ms : 0ms));
    }
  }
  const auto merged = cohort::merge_timelines(dir.path);
  REQUIRE(merged.common_steps.size() == 5);
  CHECK(merged.missing_ranks.empty());
  const auto ends = step_ends(merged.document);
  for (const std::string step : {"step 1", "step 2", "step 4", "step 5"}) {
    INFO(step << ": rank 0 ends at " << ends.at(0).at(step) << " us, rank 1 at " << ends.at(1).at(step) << " us");
    CHECK(std::abs(ends.at(0).at(step) - ends.at(1).at(step)) < 2.0);
  }
  CHECK(std::abs(ends.at(1).at("step 3") - ends.at(0).at("step 3") - 3000.0) < 2.0);
}

TEST_CASE("cohort-trace timeline says which ranks wrote no timeline and when none can be aligned", "[timeline]") {
  struct place {
    int rank_in_group, ranks;
    int rank() const { return rank_in_group; }
    int world_size() const { return ranks; }
  };
  scratch_dir dir("unaligned");
  {
    // Ranks 0 and 2 of 3 (rank 1 ended no step); rank 0 keeps steps 1 and 2, rank 2 only its
    // last, step 4.
    place first{0, 3}, last{2, 3};
    cohort::timeline zero(first, {.directory = dir.path.string()});
    cohort::timeline two(last, {.directory = dir.path.string(), .keep_steps = 1});
    auto end = cohort::timeline::clock::now();
    for (int step = 1; step <= 4; ++step) {
      end += 10ms;
      if (step <= 2) zero.end_step(end);
      two.end_step(end);
    }
  }
  const auto merged = cohort::merge_timelines(dir.path);
  CHECK(merged.ranks.size() == 2);
  CHECK(merged.missing_ranks == std::vector<int>{1});
  CHECK(merged.common_steps.empty());
  CHECK_FALSE(merged.document.at("otherData").at("aligned").as_bool());
}

TEST_CASE("Gloo ranks' timelines hold the state's waits and merge with step k side by side", "[timeline][gloo]") {
  struct run {
    int world;
    cohort::strategy strategy;
    bool reproducible;
  };
  for (const run r : {run{2, cohort::strategy::ddp, false}, run{4, cohort::strategy::ddp, false},
                      run{2, cohort::strategy::zero3, false}, run{4, cohort::strategy::zero3, false},
                      run{2, cohort::strategy::zero1, false}, run{2, cohort::strategy::zero2, true}}) {
    const int world = r.world;
    const auto strategy = r.strategy;
    DYNAMIC_SECTION(world << " ranks, " << cohort::to_string(strategy) << (r.reproducible ? ", reproducible" : "")) {
      constexpr int steps = 6;
      constexpr int slow = 1;
      scratch_dir dir("gloo_" + std::to_string(world) + std::string(cohort::to_string(strategy)));
      auto store = std::make_shared<cohort::memory_store>();
      std::size_t buckets = 0;
      std::optional<cohort::reproducible_options> reproducible;
      if (r.reproducible) reproducible = cohort::reproducible_options{static_cast<std::size_t>(world), 0};
      cohort_test::run_ranks(world, [&](int rank) {
        cohort::gloo::options options;
        options.timeout = std::chrono::seconds(5);
        group pg(store, cohort::launch_env::explicit_ranks(rank, world), options);
        cohort::timeline timeline(pg, {.directory = dir.path.string()});
        const std::vector<cohort::region> regions{{"a", 0, 4096, 0}, {"b", 4096, 256, 1}, {"c", 4352, 64, 2}};
        cohort::training_state<cohort::gloo> state{pg,
                                                   regions,
                                                   {.strategy = strategy,
                                                    .bucket_bytes = 4096,
                                                    .sgd = cohort::sgd_options{.lr = 0.1},
                                                    .timeline = &timeline,
                                                    .reproducible = reproducible}};
        if (rank == 0) buckets = state.bucket_count();
        state.load_parameters(std::vector<float>(4416, 0.0f));
        for (int step = 1; step <= steps; ++step) {
          {
            auto forward = timeline.span("forward");
            for (std::size_t l = 0; l < regions.size(); ++l) (void)state.gather(l);
          }
          auto backward = timeline.span("backward");
          // A slower rank: the others' waits for it are theirs to show.
          if (rank == slow) std::this_thread::sleep_for(10ms);
          for (std::size_t l = regions.size(); l-- > 0;) {
            (void)state.gather(l);
            for (auto& g : state.gradient(l)) g = 1.0f;
            state.mark_layer_ready(l);
          }
          backward.end();
          state.step();
        }
      });
      for (int rank = 0; rank < world; ++rank) {
        const json document = read_json(dir.path / ("rank" + std::to_string(rank) + ".timeline.json"));
        const auto spans = check_trace_events(document);
        std::map<std::string, int> names;
        for (const json* e : spans) ++names[e->at("name").as_string()];
        CHECK(names["step: reductions"] == steps);
        CHECK(names["step: update"] == steps);
        CHECK(names["forward"] == steps);
        CHECK(names["step 3"] == 1);
        if (strategy == cohort::strategy::zero3) CHECK(names["gather wait layer 0"] == 2 * steps);
        // Each bucket's reduction from hand-off to completion, once a step, on the bucket's
        // row, inside its step (the step waited for it); zero3's gathers and their lifetimes too.
        std::map<std::uint64_t, std::pair<double, double>> step_spans;
        for (const json* e : spans)
          if (e->at("cat").as_string() == "step")
            step_spans[static_cast<std::uint64_t>(e->at("args").at("step").as_int64())] = {
                e->at("ts").as_number(), e->at("ts").as_number() + e->at("dur").as_number()};
        const std::string reduction = r.reproducible                      ? "canonical sum"
                                      : strategy == cohort::strategy::ddp ? "all-reduce"
                                                                          : "reduce-scatter";
        REQUIRE(buckets >= 2);
        for (std::size_t b = 0; b < buckets; ++b) {
          INFO("rank " << rank << " bucket " << b);
          std::vector<std::uint64_t> reduced_in;
          for (const json* e : spans) {
            if (e->at("name").as_string() != reduction + " bucket " + std::to_string(b)) continue;
            CHECK(e->at("cat").as_string() == "engine");
            CHECK(e->at("tid").as_int64() == static_cast<std::int64_t>(1 + b));
            const auto step = static_cast<std::uint64_t>(e->at("args").at("step").as_int64());
            reduced_in.push_back(step);
            const auto [step_begin, step_end] = step_spans.at(step);
            CHECK(e->at("ts").as_number() >= step_begin - 1);  // the file's microseconds, rounded
            CHECK(e->at("ts").as_number() + e->at("dur").as_number() <= step_end + 1);
          }
          std::vector<std::uint64_t> every_step(steps);
          std::iota(every_step.begin(), every_step.end(), std::uint64_t{1});
          CHECK(reduced_in == every_step);
          if (strategy == cohort::strategy::zero3) {
            CHECK(names["gather bucket " + std::to_string(b)] >= steps);
            CHECK(names["gathered bucket " + std::to_string(b)] >= steps);
          }
        }
        // The rows are named: the bucket and its layer.
        std::size_t named_rows = 0;
        for (const auto& e : document.at("traceEvents").as_array())
          if (e.at("name").as_string() == "thread_name" && e.at("args").at("name").as_string().rfind("bucket ", 0) == 0)
            ++named_rows;
        CHECK(named_rows == buckets);
      }
      const auto merged = cohort::merge_timelines(dir.path);
      CHECK(merged.unnested == 0);
      const auto spans = check_trace_events(merged.document);
      CHECK(merged.common_steps.size() == steps);
      CHECK(merged.aligned_on_step == 1);
      REQUIRE(merged.ranks.size() == static_cast<std::size_t>(world));
      // Step k of every rank side by side: each step holds collectives every rank must enter,
      // so on one clock step k of each rank overlaps step k of every other (a fixed bound on
      // the begins' spread would fail whenever a loaded host descheduled one rank).
      for (int k = 1; k <= steps; ++k) {
        double latest_begin = 0, earliest_end = 1e300;
        std::size_t found = 0;
        for (const json* e : spans)
          if (e->at("name").as_string() == "step " + std::to_string(k)) {
            ++found;
            latest_begin = std::max(latest_begin, e->at("ts").as_number());
            earliest_end = std::min(earliest_end, e->at("ts").as_number() + e->at("dur").as_number());
          }
        REQUIRE(found == static_cast<std::size_t>(world));
        INFO("step " << k << ": latest begin " << latest_begin << " us, earliest end " << earliest_end << " us");
        CHECK(latest_begin < earliest_end);
      }
      // The slowed rank computes longer; the others wait for it.
      for (const auto& split : merged.ranks) {
        INFO("rank " << split.rank << " step " << split.step_ms << " compute " << split.compute_ms << " exposed "
                     << split.exposed_ms << " other " << split.other_ms);
        CHECK(split.steps == steps - 1);
        CHECK(std::abs(split.compute_ms + split.exposed_ms + split.other_ms - split.step_ms) <
              1e-3 * split.step_ms + 1e-3);
        if (split.rank == slow)
          CHECK(split.compute_ms >= 8);
        else if (!r.reproducible)  // there the micro-steps' agreement, in the backward, waits for it
          CHECK(split.exposed_ms >= 5);
      }
      const std::string svg = cohort::timeline_svg(merged.ranks);
      CHECK(svg.find("<svg") == 0);
      CHECK(svg.find("rank " + std::to_string(world - 1)) != std::string::npos);
    }
  }
}

TEST_CASE("hybrid sharding: each bucket's exchange across the replicas is a span on the bucket's row",
          "[timeline][gloo][hybrid]") {
  // 4 ranks as 2 nodes of 2: sharded within a node, each part averaged (or, reproducible,
  // gathered and summed on in the canonical tree) across the nodes after the node's reduction.
  for (const bool reproducible : {false, true}) {
    DYNAMIC_SECTION("zero2" << (reproducible ? ", reproducible" : "")) {
      constexpr int world = 4, steps = 4;
      scratch_dir dir(std::string("hybrid_") + (reproducible ? "reproducible" : "default"));
      auto store = std::make_shared<cohort::memory_store>();
      std::size_t buckets = 0;
      std::optional<cohort::reproducible_options> options_reproducible;
      if (reproducible) options_reproducible = cohort::reproducible_options{static_cast<std::size_t>(world), 0};
      cohort_test::run_ranks(world, [&](int rank) {
        cohort::gloo::options options;
        options.timeout = std::chrono::seconds(5);
        group pg(store, cohort::launch_env::explicit_ranks(rank, world), options);
        auto shards = pg.split(rank / 2, rank);
        auto replicas = pg.split(rank % 2, rank);
        cohort::timeline timeline(pg, {.directory = dir.path.string()});
        const std::vector<cohort::region> regions{{"a", 0, 4096, 0}, {"b", 4096, 256, 1}, {"c", 4352, 64, 2}};
        cohort::training_state<cohort::gloo> state{*shards,
                                                   regions,
                                                   {.strategy = cohort::strategy::zero2,
                                                    .bucket_bytes = 4096,
                                                    .sgd = cohort::sgd_options{.lr = 0.1},
                                                    .timeline = &timeline,
                                                    .reproducible = options_reproducible},
                                                   &*replicas};
        if (rank == 0) buckets = state.bucket_count();
        state.load_parameters(std::vector<float>(4416, 0.0f));
        for (int step = 1; step <= steps; ++step) {
          for (std::size_t l = regions.size(); l-- > 0;) {
            // World rank 3 (node 1's second rank) is late with its last layer's gradients:
            // its node and its replica wait for it, and the spans must still hold.
            if (rank == 3 && l == 0) std::this_thread::sleep_for(5ms);
            for (auto& g : state.gradient(l)) g = 1.0f;
            state.mark_layer_ready(l);
          }
          state.step();
        }
      });
      REQUIRE(buckets >= 2);
      const std::string reduction = reproducible ? "canonical sum" : "reduce-scatter";
      for (int rank = 0; rank < world; ++rank) {
        const json document = read_json(dir.path / ("rank" + std::to_string(rank) + ".timeline.json"));
        const auto spans = check_trace_events(document);  // pointers into the document
        std::map<std::uint64_t, std::pair<double, double>> step_spans;
        for (const json* e : spans)
          if (e->at("cat").as_string() == "step")
            step_spans[static_cast<std::uint64_t>(e->at("args").at("step").as_int64())] = {
                e->at("ts").as_number(), e->at("ts").as_number() + e->at("dur").as_number()};
        for (std::size_t b = 0; b < buckets; ++b) {
          INFO("rank " << rank << " bucket " << b);
          // step -> when the bucket's reduction in the node ended
          std::map<std::uint64_t, double> reduced_at;
          for (const json* e : spans)
            if (e->at("name").as_string() == reduction + " bucket " + std::to_string(b))
              reduced_at[static_cast<std::uint64_t>(e->at("args").at("step").as_int64())] =
                  e->at("ts").as_number() + e->at("dur").as_number();
          std::vector<std::uint64_t> across_in;
          for (const json* e : spans) {
            if (e->at("name").as_string() != "across replicas bucket " + std::to_string(b)) continue;
            CHECK(e->at("cat").as_string() == "engine");
            CHECK(e->at("tid").as_int64() == static_cast<std::int64_t>(1 + b));
            const auto step = static_cast<std::uint64_t>(e->at("args").at("step").as_int64());
            across_in.push_back(step);
            const auto [step_begin, step_end] = step_spans.at(step);
            CHECK(e->at("ts").as_number() + e->at("dur").as_number() <= step_end + 1);
            REQUIRE(reduced_at.count(step) == 1);
            // Issued once the node's reduction is done (a host engine waits for it), in the step.
            CHECK(e->at("ts").as_number() >= reduced_at.at(step) - 1);
            CHECK(e->at("ts").as_number() >= step_begin - 1);
          }
          std::vector<std::uint64_t> every_step(steps);
          std::iota(every_step.begin(), every_step.end(), std::uint64_t{1});
          CHECK(across_in == every_step);
        }
      }
    }
  }
}

TEST_CASE("a checkpoint's copies, write and read are spans on rows of their own", "[timeline][gloo][checkpoint]") {
  constexpr int world = 2;
  scratch_dir dir("checkpoint");
  const fs::path saved = dir.path / "checkpoints";
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    cohort::gloo::options options;
    options.timeout = std::chrono::seconds(5);
    group pg(store, cohort::launch_env::explicit_ranks(rank, world), options);
    cohort::timeline timeline(pg, {.directory = dir.path.string()});
    const std::vector<cohort::region> regions{{"a", 0, 1 << 16, 0}, {"b", 1 << 16, 256, 1}};
    cohort::training_state<cohort::gloo> state{
        pg,
        regions,
        {.strategy = cohort::strategy::zero2, .sgd = cohort::sgd_options{.lr = 0.1}, .timeline = &timeline}};
    state.load_parameters(std::vector<float>((1 << 16) + 256, 1.0f));
    cohort::async_checkpointer<cohort::gloo, float, float> saver(state);
    for (int step = 1; step <= 3; ++step) {
      for (std::size_t l = regions.size(); l-- > 0;) {
        for (auto& g : state.gradient(l)) g = 1.0f;
        state.mark_layer_ready(l);
      }
      state.step();
      if (step == 1) (void)saver.save(saved.string(), 1);  // its copy overlaps step 2
    }
    const auto written = saver.wait();
    (void)cohort::load_checkpoint(state, written.value().path);
    state.step();
  });
  for (int rank = 0; rank < world; ++rank) {
    const json document = read_json(dir.path / ("rank" + std::to_string(rank) + ".timeline.json"));
    const auto spans = check_trace_events(document);
    std::map<std::string, std::vector<const json*>> by_name;
    for (const json* e : spans) by_name[e->at("name").as_string()].push_back(e);
    for (const auto* name : {"checkpoint: copy to host staging", "checkpoint: write", "checkpoint: read and verify",
                             "checkpoint: copy from host staging"}) {
      INFO("rank " << rank << ": " << name);
      REQUIRE(by_name[name].size() == 1);
      const json& e = *by_name[name].front();
      CHECK(e.at("cat").as_string() == "checkpoint");
      CHECK(e.at("tid").as_int64() > 0);  // a row of its own, beside the training thread's
    }
    // The save began after step 1: its spans are step 2's, and the write ends after the copy
    // it drains began.
    CHECK(by_name["checkpoint: copy to host staging"].front()->at("args").at("step").as_int64() == 2);
    const json& copy = *by_name["checkpoint: copy to host staging"].front();
    const json& write = *by_name["checkpoint: write"].front();
    CHECK(write.at("ts").as_number() + write.at("dur").as_number() >= copy.at("ts").as_number());
  }
}
