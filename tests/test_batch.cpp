// Effective-batch planner, launch guard, loader-worker advice and per-device batch sequences.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cohort/data/batch.hpp"
#include "support.hpp"

#if __has_include(<gloo/context.h>)
#include "cohort/comm/gloo.hpp"
#include "cohort/comm/process_group.hpp"
#endif

namespace {

struct fake_group {
  int my_rank, my_size;
  int rank() const { return my_rank; }
  int world_size() const { return my_size; }
};

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("batch: effective batch is per_device x accumulation x world", "[batch]") {
  CHECK(cohort::batch_plan{.per_device = 2, .accumulation = 8, .world = 1}.effective() == 16);
  CHECK(cohort::batch_plan{.per_device = 32, .accumulation = 1, .world = 8}.effective() == 256);
  CHECK(cohort::batch_plan{.per_device = 65536, .accumulation = 65536, .world = 1024}.effective() ==
        std::int64_t{1} << 42);  // no int overflow
  CHECK(cohort::batch_plan{.per_device = 2, .accumulation = 8, .world = 4, .learning_rate = 0.1}.summary() ==
        "per-device batch 2 x accumulation 8 x world 4 = effective batch 64, learning rate 0.1");
}

TEST_CASE("batch: rescaling keeps the effective batch by dividing accumulation", "[batch]") {
  const cohort::batch_plan plan{.per_device = 2, .accumulation = 8, .world = 1, .learning_rate = 0.1};
  const auto on_four = plan.rescaled_for(4);
  CHECK(on_four.per_device == 2);
  CHECK(on_four.accumulation == 2);
  CHECK(on_four.world == 4);
  CHECK(on_four.learning_rate == 0.1);
  CHECK(on_four.effective() == plan.effective());

  // Shrinking the world multiplies accumulation.
  const auto back = on_four.rescaled_for(2);
  CHECK(back.accumulation == 4);
  CHECK(back.effective() == plan.effective());

  // Exhaustively: it succeeds exactly when accumulation * world divides by the new world, and
  // then keeps per_device and the effective batch.
  for (int accumulation = 1; accumulation <= 12; ++accumulation)
    for (int world = 1; world <= 8; ++world)
      for (int new_world = 1; new_world <= 16; ++new_world) {
        const cohort::batch_plan p{.per_device = 3, .accumulation = accumulation, .world = world};
        INFO("accumulation=" << accumulation << " world=" << world << " new_world=" << new_world);
        if ((accumulation * world) % new_world == 0) {
          const auto q = p.rescaled_for(new_world);
          CHECK(q.effective() == p.effective());
          CHECK(q.per_device == 3);
          CHECK(q.world == new_world);
        } else {
          CHECK_THROWS_AS(p.rescaled_for(new_world), cohort::error);
        }
      }
}

TEST_CASE("batch: an impossible rescale names the nearest valid world sizes", "[batch]") {
  const cohort::batch_plan plan{.per_device = 2, .accumulation = 3, .world = 2};  // 6 micro-batches
  try {
    (void)plan.rescaled_for(4);
    FAIL("expected an error");
  } catch (const cohort::error& e) {
    const std::string text = e.what();
    INFO(text);
    // Divisors of 6 nearest to 4, found here by brute force: 3 below and 6 above.
    int below = 0, above = 0;
    for (int w = 3; w >= 1 && !below; --w)
      if (6 % w == 0) below = w;
    for (int w = 5; w <= 6 && !above; ++w)
      if (6 % w == 0) above = w;
    CHECK(contains(text, "world 4"));
    CHECK(contains(text, "effective batch 12"));
    CHECK(contains(text, " " + std::to_string(below) + " (accumulation " + std::to_string(6 / below) + ")"));
    CHECK(contains(text, " " + std::to_string(above) + " (accumulation " + std::to_string(6 / above) + ")"));
    CHECK(contains(text, "keep::accumulation"));
  }
  CHECK_THROWS_AS(plan.rescaled_for(0), cohort::error);
  CHECK_THROWS_AS((cohort::batch_plan{.per_device = 0}.rescaled_for(1)), cohort::error);
}

TEST_CASE("batch: keeping accumulation scales the learning rate linearly and reminds of warm-up", "[batch]") {
  const cohort::batch_plan plan{.per_device = 4, .accumulation = 2, .world = 2, .learning_rate = 0.1};
  const auto bigger = plan.rescaled_for(8, cohort::keep::accumulation);
  CHECK(bigger.accumulation == 2);
  CHECK(bigger.world == 8);
  CHECK(bigger.effective() == 64);
  CHECK(bigger.learning_rate == Approx(0.1 * 64.0 / 16.0));
  CHECK(contains(bigger.note, "warm"));
  CHECK(contains(bigger.note, "16 -> 64"));

  const auto smaller = plan.rescaled_for(1, cohort::keep::accumulation);
  CHECK(smaller.learning_rate == Approx(0.1 * 8.0 / 16.0));
  CHECK_FALSE(contains(smaller.note, "warm"));  // a smaller rate needs no warm-up
}

TEST_CASE("batch: launching on another world size fails loudly unless acknowledged", "[batch]") {
  const cohort::batch_plan configured{.per_device = 2, .accumulation = 8, .world = 1, .learning_rate = 0.1};

  // Same world: every rank gets the plan, only rank 0 prints, one line.
  for (int rank = 0; rank < 1; ++rank) {
    fake_group group{rank, 1};
    std::ostringstream out;
    const auto plan = cohort::launch_plan(configured, group, cohort::world_change::refuse, out);
    CHECK(plan.effective() == 16);
    CHECK(out.str() == "cohort: " + configured.summary() + "\n");
  }

  // Another world, not acknowledged: every rank throws, naming both sizes.
  for (int rank = 0; rank < 4; ++rank) {
    fake_group group{rank, 4};
    std::ostringstream out;
    try {
      (void)cohort::launch_plan(configured, group, cohort::world_change::refuse, out);
      FAIL("expected an error");
    } catch (const cohort::error& e) {
      CHECK(contains(e.what(), "configured for world size 1"));
      CHECK(contains(e.what(), "launched on 4 ranks"));
      CHECK(e.rank() == rank);
    }
    CHECK(out.str().empty());
  }

  // Acknowledged: rescaled, and the summary is printed by rank 0 only.
  for (int rank = 0; rank < 4; ++rank) {
    fake_group group{rank, 4};
    std::ostringstream out;
    const auto plan = cohort::launch_plan(configured, group, cohort::world_change::keep_effective_batch, out);
    CHECK(plan.accumulation == 2);
    CHECK(plan.world == 4);
    CHECK(plan.effective() == 16);
    if (rank == 0) {
      const auto text = out.str();
      CHECK(contains(text, "effective batch 16"));
      CHECK(contains(text, "rescaled from world 1"));
      CHECK(std::count(text.begin(), text.end(), '\n') == 1);
    } else {
      CHECK(out.str().empty());
    }
  }
  fake_group four{0, 4};
  std::ostringstream out;
  const auto linear = cohort::launch_plan(configured, four, cohort::world_change::keep_accumulation, out);
  CHECK(linear.learning_rate == Approx(0.4));
  CHECK(contains(out.str(), "warm"));
}

TEST_CASE("batch: a global batch splits into per-device x accumulation x world", "[batch]") {
  const cohort::global_batch configured{.size = 512, .accumulation = 2, .learning_rate = 0.1};
  const auto plan = configured.plan_for(4);
  CHECK(plan.per_device == 64);
  CHECK(plan.accumulation == 2);
  CHECK(plan.world == 4);
  CHECK(plan.learning_rate == 0.1);
  CHECK(plan.effective() == 512);
  CHECK(plan.summary() == "per-device batch 64 x accumulation 2 x world 4 = effective batch 512, learning rate 0.1");
  // Exhaustively: it splits exactly when world x accumulation divides the global batch.
  for (std::int64_t size = 1; size <= 40; ++size)
    for (int accumulation = 1; accumulation <= 4; ++accumulation)
      for (int world = 1; world <= 6; ++world) {
        INFO("size=" << size << " accumulation=" << accumulation << " world=" << world);
        const cohort::global_batch g{.size = size, .accumulation = accumulation};
        if (size % (world * accumulation) == 0)
          CHECK(g.plan_for(world).effective() == size);
        else
          CHECK_THROWS_AS(g.plan_for(world), cohort::error);
      }
  CHECK_THROWS_AS((cohort::global_batch{.size = 0}.plan_for(1)), cohort::error);
  CHECK_THROWS_AS((cohort::global_batch{.size = 8, .accumulation = 0}.plan_for(1)), cohort::error);
  CHECK_THROWS_AS((cohort::global_batch{.size = 8}.plan_for(0)), cohort::error);
}

TEST_CASE("batch: a global batch that does not split names the numbers and the nearest that do", "[batch]") {
  auto message = [](const cohort::global_batch& g, int world) {
    try {
      (void)g.plan_for(world);
    } catch (const cohort::error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const auto text = message({.size = 500, .accumulation = 2}, 4);
  INFO(text);
  CHECK(contains(text, "global batch 500 does not split over world 4 x accumulation 2 = 8 micro-batches"));
  CHECK(contains(text, "500/8 = 62.5"));
  // The nearest multiples of 8 around 500, found here by brute force.
  std::int64_t below = 500, above = 500;
  while (below % 8 != 0) --below;
  while (above % 8 != 0) ++above;
  CHECK(contains(text, std::to_string(below) + " (per-device batch " + std::to_string(below / 8) + ")"));
  CHECK(contains(text, std::to_string(above) + " (per-device batch " + std::to_string(above / 8) + ")"));
  // 500 / 4 = 125 per rank: accumulation 1 or 5 keeps 500 (125 = 5^3).
  CHECK(contains(text, "keep global batch 500 with accumulation 1 (per-device batch 125) or 5 (per-device batch 25)"));

  const auto tiny = message({.size = 3}, 4);
  INFO(tiny);
  CHECK(contains(tiny, "3/4 = 0.75, less than one"));
  CHECK(contains(tiny, "4 (per-device batch 1)"));
  CHECK_FALSE(contains(tiny, "0 (per-device batch 0)"));
  CHECK_FALSE(contains(tiny, "keep global batch"));  // 3 is not a multiple of 4
}

TEST_CASE("batch: launch_plan from a global batch plans for the group and prints on rank 0", "[batch]") {
  const cohort::global_batch configured{.size = 96, .accumulation = 4};
  for (int rank = 0; rank < 3; ++rank) {
    fake_group group{rank, 3};
    std::ostringstream out;
    const auto plan = cohort::launch_plan(configured, group, out);
    CHECK(plan.per_device == 8);
    CHECK(plan.world == 3);
    CHECK(out.str() == (rank == 0 ? "cohort: per-device batch 8 x accumulation 4 x world 3 = effective batch 96 "
                                    "(from global batch 96)\n"
                                  : ""));
  }
  fake_group five{0, 5};
  std::ostringstream out;
  CHECK_THROWS_WITH(cohort::launch_plan(configured, five, out), Catch::Contains("does not split over world 5"));
}

#if __has_include(<gloo/context.h>)
TEST_CASE("batch: a rank configured with another global batch is refused on every rank", "[batch][gloo]") {
  constexpr int world = 3;
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::string> errors(world);
  std::vector<cohort::batch_plan> plans(world);
  cohort_test::run_ranks(world, [&](int rank) {
    cohort::gloo::options opts;
    opts.timeout = std::chrono::seconds(20);
    cohort::process_group<cohort::gloo> pg(store, cohort::launch_env::explicit_ranks(rank, world), opts);
    std::ostringstream out;
    // Agreeing ranks: the same plan everywhere.
    plans[static_cast<std::size_t>(rank)] =
        cohort::launch_plan(cohort::global_batch{.size = 384, .accumulation = 2}, pg, out);
    // Rank 2 read another configuration (1024 does not split over 3 ranks either: the
    // disagreement is reported first, on every rank, instead of rank 2 failing alone).
    const cohort::global_batch mine{.size = rank == 2 ? 1024 : 512, .accumulation = 2};
    try {
      (void)cohort::launch_plan(mine, pg, out);
    } catch (const cohort::error& e) {
      errors[static_cast<std::size_t>(rank)] = e.what();
    }
  });
  for (const auto& plan : plans) {
    CHECK(plan.per_device == 64);
    CHECK(plan.effective() == 384);
  }
  for (int rank = 0; rank < world; ++rank) {
    const auto& text = errors[static_cast<std::size_t>(rank)];
    INFO("rank " << rank << ": " << text);
    CHECK(contains(text, "configured with different global batches"));
    CHECK(contains(text, "this rank has global batch " + std::string(rank == 2 ? "1024" : "512") + ", accumulation 2"));
    CHECK(contains(text, "across the ranks global batch ranges 512..1024"));
    CHECK_FALSE(contains(text, "accumulation ranges"));
  }
}
#endif

TEST_CASE("batch: loader workers share the cores and warn when oversubscribed", "[batch]") {
  std::vector<std::string> warnings;
  auto collect = [&](std::string_view m) { warnings.emplace_back(m); };

  const auto fits = cohort::suggest_loader_workers(32, 4, -1, collect);
  CHECK(fits.per_rank == 7);  // 32 cores / 4 ranks = 8, one kept for the training process
  CHECK(fits.total == 28);
  CHECK(fits.total + 4 <= 32);
  CHECK(warnings.empty());

  const auto few_cores = cohort::suggest_loader_workers(4, 8, -1, collect);
  CHECK(few_cores.per_rank == 0);
  CHECK(warnings.size() == 1);  // 8 training processes on 4 cores is already too many

  warnings.clear();
  const auto requested = cohort::suggest_loader_workers(16, 4, 8, collect);
  CHECK(requested.per_rank == 8);
  CHECK(requested.total == 32);
  REQUIRE(warnings.size() == 1);
  CHECK(contains(warnings[0], "16 cores"));
  CHECK(contains(requested.warning, "suggested: 3"));

  CHECK_THROWS_AS(cohort::suggest_loader_workers(8, 0), cohort::error);
  CHECK(cohort::suggest_loader_workers_for_this_machine(1, -1, collect).per_rank >= 0);
}

TEST_CASE("batch: micro-batches tile the rank's indices and sync at the end of each step", "[batch]") {
  for (std::uint64_t n : {1u, 22u, 23u, 40u, 97u}) {
    for (int per_device : {1, 3, 4}) {
      for (int accumulation : {1, 2, 3}) {
        for (auto partial : {cohort::partial_batch::keep, cohort::partial_batch::drop}) {
          INFO("n=" << n << " per_device=" << per_device << " accumulation=" << accumulation
                    << " keep_partial=" << (partial == cohort::partial_batch::keep));
          cohort::distributed_sampler sampler{n, 2, 1, {.shuffle = true, .seed = 11}};
          sampler.set_epoch(4);
          const auto expected_indices = sampler.indices();
          sampler.set_epoch(4);  // a fresh pass, so iterating below does not warn
          cohort::batch_sequence batches{sampler, per_device, accumulation, partial};

          std::vector<cohort::micro_batch> seen;
          for (auto batch : batches) seen.push_back(batch);
          REQUIRE(seen.size() == batches.size());

          // Independent expectation: cut the index list into chunks of per_device.
          std::vector<std::vector<std::uint64_t>> chunks;
          for (std::size_t i = 0; i < expected_indices.size(); i += static_cast<std::size_t>(per_device)) {
            std::vector<std::uint64_t> chunk(
                expected_indices.begin() + static_cast<std::ptrdiff_t>(i),
                expected_indices.begin() + static_cast<std::ptrdiff_t>(std::min(
                                               expected_indices.size(), i + static_cast<std::size_t>(per_device))));
            if (chunk.size() < static_cast<std::size_t>(per_device) && partial == cohort::partial_batch::drop) break;
            chunks.push_back(chunk);
          }
          REQUIRE(seen.size() == chunks.size());
          const std::size_t steps =
              (chunks.size() + static_cast<std::size_t>(accumulation) - 1) / static_cast<std::size_t>(accumulation);
          CHECK(batches.steps() == steps);
          std::size_t syncs = 0;
          for (std::size_t b = 0; b < seen.size(); ++b) {
            CHECK(seen[b].indices == chunks[b]);
            CHECK(seen[b].batch == b);
            CHECK(seen[b].is_partial() == (chunks[b].size() < static_cast<std::size_t>(per_device)));
            // The micro-batches of step s are [s*a, min((s+1)*a, count)).
            const std::size_t step = seen[b].step;
            CHECK(step * static_cast<std::size_t>(accumulation) + static_cast<std::size_t>(seen[b].micro_step) == b);
            const std::size_t step_end = std::min((step + 1) * static_cast<std::size_t>(accumulation), seen.size());
            CHECK(static_cast<std::size_t>(seen[b].micro_steps) ==
                  step_end - step * static_cast<std::size_t>(accumulation));
            CHECK(seen[b].sync == (b + 1 == step_end));
            syncs += seen[b].sync ? 1 : 0;
          }
          CHECK(syncs == steps);  // one gradient sync per optimizer step, none left pending
        }
      }
    }
  }
}

TEST_CASE("batch: every rank yields the same steps and syncs at the same micro-batches", "[batch]") {
  const cohort::batch_plan plan{.per_device = 4, .accumulation = 3, .world = 3};
  std::vector<std::vector<std::pair<std::size_t, bool>>> schedules;
  for (int rank = 0; rank < 3; ++rank) {
    cohort::distributed_sampler sampler{50, 3, rank, {.shuffle = true}};
    cohort::batch_sequence batches{sampler, plan};
    std::vector<std::pair<std::size_t, bool>> schedule;
    for (auto batch : batches) schedule.emplace_back(batch.step, batch.sync);
    schedules.push_back(schedule);
  }
  CHECK(schedules[0] == schedules[1]);
  CHECK(schedules[0] == schedules[2]);

  cohort::distributed_sampler sampler{50, 2, 0};
  CHECK_THROWS_AS((cohort::batch_sequence{sampler, plan}), cohort::error);  // plan for 3 ranks
  CHECK_THROWS_AS((cohort::batch_sequence{sampler, 0, 1}), cohort::error);
}

TEST_CASE("batch: a micro-batch-mode sampler's sequence is its micro-batches, numbered alike at any world size",
          "[batch]") {
  // 100 samples, steps of 8 micro-batches of 3: the fifth step padded.
  cohort::distributed_sampler whole{100, 1, 0, {.shuffle = true, .seed = 8}};
  const auto list = whole.indices();
  for (int world : {1, 2, 4}) {
    const int run = 8 / world;
    for (int rank = 0; rank < world; ++rank) {
      INFO("world " << world << " rank " << rank);
      cohort::distributed_sampler sampler{
          100, world, rank, {.shuffle = true, .seed = 8, .micro_batches = 8, .micro_batch_size = 3}};
      cohort::batch_sequence batches{sampler, 3, run};
      CHECK(batches.steps() == 5);
      for (const auto& batch : batches) {
        // Micro-step k of a step is the step's micro-batch rank * run + k.
        const std::size_t micro_batch = static_cast<std::size_t>(rank * run + batch.micro_step);
        std::vector<std::uint64_t> expected;
        for (std::size_t o = 0; o < 3; ++o) expected.push_back(list[(batch.step * 24 + micro_batch * 3 + o) % 100]);
        CHECK(batch.indices == expected);
        CHECK(batch.sync == (batch.micro_step == run - 1));
      }
    }
  }
  cohort::distributed_sampler sampler{100, 4, 1, {.micro_batches = 8, .micro_batch_size = 3}};
  try {
    cohort::batch_sequence wrong{sampler, 6, 1};
    FAIL("expected an error");
  } catch (const cohort::error& e) {
    CHECK(std::string(e.what()).find("2 micro-batches of 3 samples per step, but the sequence was asked for "
                                     "per_device 6 and accumulation 1") != std::string::npos);
  }
}

TEST_CASE("batch: iterating batches twice without set_epoch warns once", "[batch]") {
  std::vector<std::string> warnings;
  cohort::distributed_sampler sampler{
      30, 2, 0, {.shuffle = true, .warn = [&](std::string_view m) { warnings.emplace_back(m); }}};
  cohort::batch_sequence batches{sampler, 4, 2};
  for (int epoch = 0; epoch < 2; ++epoch)
    for ([[maybe_unused]] auto batch : batches) {}
  CHECK(warnings.size() == 1);
  sampler.set_epoch(1);
  for ([[maybe_unused]] auto batch : batches) {}
  CHECK(warnings.size() == 1);
}
