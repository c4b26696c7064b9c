// The README's tour, run for real on 2 Gloo ranks (the README shows the NCCL flavour; the
// calls are the same). If this stops compiling or passing, the README is lying.
#include <catch2/catch.hpp>

#include <cohort/cohort.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "support.hpp"

TEST_CASE("the README tour runs on two Gloo ranks", "[readme]") {
  auto store = std::make_shared<cohort::memory_store>();
  const auto directory = std::filesystem::temp_directory_path() / ("cohort-readme-" + std::to_string(::getpid()));
  std::filesystem::create_directories(directory);
  std::ostringstream summaries;
  cohort_test::run_ranks(2, [&](int rank) {
    const auto env = cohort::launch_env::explicit_ranks(rank, 2);
    cohort::process_group<cohort::gloo> pg{store, env};
    RANK_CHECK(pg.rank() == rank && pg.world_size() == 2);

    std::vector<float> grad(10, static_cast<float>(rank));
    auto work = pg.all_reduce(std::span<float>(grad), cohort::op::avg);
    RANK_CHECK(work.wait_for(std::chrono::seconds(20)));
    RANK_CHECK(grad[9] == 0.5f);
    pg.on(nullptr).all_reduce(std::span<float>(grad));  // Gloo: the calling thread is the stream
    RANK_CHECK(grad[9] == 1.0f);
    const float loss = static_cast<float>(rank);
    const float mean_loss = cohort::all_reduce_value(pg, loss, cohort::op::avg);
    RANK_CHECK(mean_loss == 0.5f);

    // Data parallelism or ZeRO by one option; ZeRO-2 through the training state.
    {
      std::vector<float> flat_params(12, 1.0f), flat_grads(12, static_cast<float>(rank + 1));
      const std::vector<cohort::region> regions{{"w", 0, 8, 0, true}, {"b", 8, 4, 1, false}};
      cohort::training_state<cohort::gloo, float> state{pg,
                                                        regions,
                                                        {.strategy = cohort::strategy::zero2,
                                                         .adam = {.lr = 3e-4, .weight_decay = 0.1},
                                                         .max_grad_norm = 0.5}};  // below the norm, 1.5 x sqrt(12)
      state.set_stream(nullptr);  // Gloo: the calling thread is the stream
      state.load_parameters(flat_params);
      for (std::size_t r = regions.size(); r-- > 0;) {
        const auto gradient = state.gradient(r);
        std::copy_n(flat_grads.begin() + static_cast<std::ptrdiff_t>(regions[r].offset), gradient.size(),
                    gradient.begin());
        state.mark_ready(r);
      }
      const auto result = state.step();
      RANK_CHECK(!result.skipped && result.clip_factor < 1.0);
      RANK_CHECK(std::abs(result.grad_norm - 1.5 * std::sqrt(12.0)) < 1e-5);  // of the average, on every rank
      flat_params = state.gather_parameters();
      RANK_CHECK(flat_params[0] < 1.0f);  // one AdamW step, the same on both ranks
      {
        auto scope = state.no_sync();
        for (std::size_t r = regions.size(); r-- > 0;) state.mark_ready(r);
        RANK_CHECK(state.launched_buckets() == 0);  // nothing communicated inside the scope
      }
    }

    // Sampler.
    cohort::distributed_sampler sampler{100, pg, {.shuffle = true, .seed = 0}};
    sampler.set_epoch(3);
    RANK_CHECK(sampler.size() == 50);

    // Guards.
    std::ostringstream mine;
    auto plan = cohort::launch_plan(cohort::batch_plan{.per_device = 2, .accumulation = 8, .world = 2}, pg,
                                    cohort::world_change::refuse, mine);
    RANK_CHECK(plan.effective() == 32);
    auto split = cohort::launch_plan(cohort::global_batch{.size = 32, .accumulation = 8}, pg, mine);
    RANK_CHECK(split.per_device == 2 && split.effective() == 32);
    if (rank == 0) summaries << mine.str();
    int downloads = 0;
    cohort::main_process_first(pg, [&] { ++downloads; });
    RANK_CHECK(downloads == 1);
    cohort::atomic_write_on_main(pg, directory / "checkpoint.bin", [&](std::ostream& out) { out << "weights"; });
    std::ifstream in(directory / "checkpoint.bin");
    std::string text;
    in >> text;
    RANK_CHECK(text == "weights");
    cohort::rank_logger log(pg);
    log("done");
    cohort::main_printf(pg, "step %d loss %.4f\n", 1, mean_loss);
  });
  std::filesystem::remove_all(directory);
  REQUIRE_THAT(summaries.str(), Catch::Contains("effective batch 32") && Catch::Contains("(from global batch 32)"));
}
