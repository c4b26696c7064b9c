// gradient_reducer in place over regions of a trainer's own flat gradient buffer, laid out
// as llm.c lays its gradients out: tensor-major, each tensor stacked over the layers, the
// backward finishing layer by layer. Gloo ranks as threads; expectations computed here.
#include <catch2/catch.hpp>

#include <cohort/backend/gloo.hpp>
#include <cohort/reducer.hpp>
#include <cohort/store.hpp>

#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "flat_fixtures.hpp"
#include "support.hpp"

namespace {

using group = cohort_test::gloo_group;  // what a communication hook receives
using reducer = cohort::gradient_reducer<cohort::gloo>;
using cohort_test::stacked_model;

float contribution(int rank, std::size_t element) { return static_cast<float>((rank + 1) * 10 + element % 7); }

}  // namespace

TEST_CASE("in place: regions of one flat buffer are averaged where they are, with no copies", "[reducer][gloo][flat]") {
  const int world = 3;
  const stacked_model model;
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    std::vector<float> grads(model.elements());
    const auto regions = model.regions();
    // Caps of 72 bytes: several buckets, each holding two layers' regions.
    reducer ddp{pg,
                cohort::flat_gradients(std::span<float>(grads), regions),
                {.first_bucket_bytes = 72, .bucket_bytes = 72, .in_place = true}};
    RANK_CHECK(ddp.storage() == cohort::gradient_storage::in_place);
    RANK_CHECK(ddp.bucket_memory_bytes() == 0);
    RANK_CHECK(ddp.copied_bytes_per_step() == 0);
    RANK_CHECK(ddp.bucket_count() > 1);
    // Adjacent regions of a bucket (the same tensor in consecutive layers) merge into runs.
    RANK_CHECK(ddp.run_count() < regions.size(), "runs " << ddp.run_count());
    for (int step = 0; step < 2; ++step) {
      for (std::size_t e = 0; e < grads.size(); ++e) grads[e] = contribution(rank, e) * static_cast<float>(step + 1);
      // Backward: last layer first; rank 1 marks each layer's tensors in the other order.
      for (std::size_t l = model.layers; l-- > 0;) {
        const std::size_t first = 1 + 2 * l, second = 2 + 2 * l;
        ddp.mark_ready(rank == 1 ? first : second);
        ddp.mark_ready(rank == 1 ? second : first);
      }
      ddp.mark_ready(0);
      ddp.finish();
      for (std::size_t e = 0; e < grads.size(); ++e) {
        float sum = 0;
        for (int r = 0; r < world; ++r) sum += contribution(r, e) * static_cast<float>(step + 1);
        RANK_CHECK(std::abs(grads[e] - sum / world) <= 1e-5f * std::abs(sum), "element " << e << ": " << grads[e]);
      }
    }
  });
}

TEST_CASE("in place: an unused region is zeroed in the caller's buffer and reduced as zero", "[reducer][gloo][flat]") {
  const int world = 2;
  const stacked_model model;
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    std::vector<float> grads(model.elements(), 1.0f + static_cast<float>(rank));
    reducer ddp{pg,
                cohort::flat_gradients(std::span<float>(grads), model.regions()),
                {.unused = cohort::unused_gradients::zero, .in_place = true}};
    // Rank 1 never produces the embedding's gradient; rank 0 does.
    for (std::size_t i = model.regions().size(); i-- > 1;) ddp.mark_ready(i);
    if (rank == 0) ddp.mark_ready(0);
    const auto summary = ddp.finish();
    RANK_CHECK(summary.unused.empty());  // some rank produced every gradient
    for (std::size_t e = 0; e < model.embedding; ++e) RANK_CHECK(grads[e] == 0.5f, "embedding " << grads[e]);
    for (std::size_t e = model.embedding; e < grads.size(); ++e) RANK_CHECK(grads[e] == 1.5f);
  });
}

TEST_CASE("in place: regions past the buffer or overlapping are refused, on every rank at once",
          "[reducer][gloo][flat][faults]") {
  std::vector<float> buffer(10);
  const std::vector<cohort::gradient_region> past{{0, 4}, {6, 5}};
  REQUIRE_THROWS_WITH(cohort::flat_gradients(std::span<float>(buffer), past),
                      Catch::Contains("region 1 (elements 6..11) ends past the buffer of 10 elements"));

  const int world = 2;
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::string> messages(world);
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    std::vector<float> grads(10);
    // Rank 1's second region starts inside its first.
    const std::vector<cohort::gradient_region> regions{{0, 4}, {rank == 1 ? 2u : 4u, 4}};
    try {
      reducer ddp{pg, cohort::flat_gradients(std::span<float>(grads), regions), {.in_place = true}};
      throw cohort_test::rank_failure("an overlapping layout was accepted");
    } catch (const cohort::error& failure) {
      messages[static_cast<std::size_t>(rank)] = failure.what();
    }
  });
  CHECK_THAT(messages[1], Catch::Contains("overlap"));
  CHECK_THAT(messages[0], Catch::Contains("rank 1 refused its gradients"));
}

TEST_CASE("in place: a rank whose regions touch where another's do not is refused, not mispaired",
          "[reducer][gloo][flat][faults]") {
  // Same gradient sizes on both ranks, but on rank 1 the two regions sit apart in its buffer:
  // rank 0 would issue one all-reduce for the bucket, rank 1 two.
  const int world = 2;
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::string> messages(world);
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    std::vector<float> grads(20);
    const std::vector<cohort::gradient_region> regions{{0, 4}, {rank == 1 ? 10u : 4u, 4}};
    try {
      reducer ddp{pg, cohort::flat_gradients(std::span<float>(grads), regions), {.in_place = true}};
      throw cohort_test::rank_failure("layouts that issue different collectives were accepted");
    } catch (const cohort::error& failure) {
      messages[static_cast<std::size_t>(rank)] = failure.what();
    }
  });
  for (const auto& text : messages) CHECK_THAT(text, Catch::Contains("bucket layouts differ across ranks"));
}

TEST_CASE("in place: hooks and compression, which need a contiguous bucket, are refused clearly",
          "[reducer][gloo][flat]") {
  auto store = std::make_shared<cohort::memory_store>();
  auto pg = cohort_test::make_gloo_group(store, 0, 1);
  std::vector<float> grads(8);
  const std::vector<cohort::gradient_region> regions{{0, 8}};
  REQUIRE_THROWS_WITH((reducer{pg,
                               cohort::flat_gradients(std::span<float>(grads), regions),
                               {.compress = cohort::compression::bfloat16, .in_place = true}}),
                      Catch::Contains("in_place with compression"));
  reducer ddp{pg, cohort::flat_gradients(std::span<float>(grads), regions), {.in_place = true}};
  REQUIRE_THROWS_WITH(ddp.register_comm_hook([](group&, const cohort::bucket_ref&) { return cohort::gloo::work(); }),
                      Catch::Contains("reduced in place"));
}
