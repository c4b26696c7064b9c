// training_state under ddp, as a DDP user pins it: buckets launched during the backward in
// the one order every rank shares, whatever order each marks in; no_sync micro-steps that
// communicate nothing; regions a rank leaves unmarked; the global norm and its clipping as
// clip_grad_norm_; gradients communicated in bfloat16; replicas that start equal; and the
// errors that name what went wrong. Gloo ranks as threads. Plain SGD at lr 1 from zero makes
// the parameters minus the averaged gradients, so what was reduced can be read back exactly.

// Other specializations than the default library's (double parameters, bfloat16 with fp32
// gradients): this unit compiles training_state's and the checkpoint's bodies itself.
#define COHORT_TEMPLATE_BODIES

#include <catch2/catch.hpp>

#include <cohort/parallel/training_state.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "flat_fixtures.hpp"
#include "support.hpp"

namespace {

using cohort::region;
using cohort::strategy;

// `count` regions of `per_region` floats, region r alone in layer r.
std::vector<region> one_per_layer(std::size_t count, std::size_t per_region) {
  std::vector<region> regions;
  for (std::size_t r = 0; r < count; ++r) regions.push_back({"t" + std::to_string(r), r * per_region, per_region, r});
  return regions;
}

cohort::training_options sgd_at_lr_one(std::size_t bucket_bytes) {
  return {.bucket_bytes = bucket_bytes, .sgd = cohort::sgd_options{.lr = 1}};
}

}  // namespace

TEST_CASE("ddp launches each bucket during the backward, last to first on every rank whatever order it marks in",
          "[training_state][ddp][gloo]") {
  const int world = 2;
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    std::vector<std::size_t> launched;
    auto options = sgd_at_lr_one(256);  // one 64-float region per bucket
    options.on_launch = [&](std::size_t b) { launched.push_back(b); };
    const auto regions = one_per_layer(4, 64);
    cohort::training_state<cohort::gloo> state{pg, regions, options};
    RANK_CHECK(state.bucket_count() == 4);
    state.load_parameters(std::vector<float>(256, 0.0f));
    // Rank 0 marks as a backward does, last layer first; rank 1 the other way round, so
    // nothing may launch on rank 1 until it marks region 3, whose bucket goes first.
    const std::vector<std::size_t> order =
        rank == 0 ? std::vector<std::size_t>{3, 2, 1, 0} : std::vector<std::size_t>{0, 1, 2, 3};
    for (const std::size_t r : order) {
      for (auto& g : state.gradient(r)) g = static_cast<float>(rank + 1);
      state.mark_ready(r);
      if (rank == 0 && r == 3) RANK_CHECK(state.launched_buckets() == 1);  // before the backward's end
      if (rank == 1 && r != 3) RANK_CHECK(state.launched_buckets() == 0);
    }
    RANK_CHECK(state.launched_buckets() == 4);
    RANK_CHECK(launched == std::vector<std::size_t>({3, 2, 1, 0}));
    state.step();
    for (const float p : state.gather_parameters()) RANK_CHECK(p == -1.5f, p);  // -(1 + 2) / 2, exactly
  });
}

TEST_CASE("ddp: no_sync micro-steps communicate nothing, and the synchronised one reduces their sum",
          "[training_state][ddp][gloo]") {
  const int world = 2, micro = 3;
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    int launches = 0;
    auto options = sgd_at_lr_one(256);
    options.on_launch = [&](std::size_t) { ++launches; };
    const auto regions = one_per_layer(3, 64);
    cohort::training_state<cohort::gloo> state{pg, regions, options};
    state.load_parameters(std::vector<float>(192, 0.0f));
    const auto micro_step = [&](int m) {
      for (std::size_t r = regions.size(); r-- > 0;) {
        for (auto& g : state.gradient(r)) g += static_cast<float>((rank + 1) * (m + 1));  // added: accumulated
        state.mark_ready(r);
      }
    };
    for (int m = 0; m + 1 < micro; ++m) {
      auto quiet = state.no_sync();
      micro_step(m);
      RANK_CHECK(state.launched_buckets() == 0);
    }
    RANK_CHECK(launches == 0, "communication inside no_sync");
    micro_step(micro - 1);
    RANK_CHECK(launches == static_cast<int>(state.bucket_count()));
    state.step();
    // The average over ranks of (rank + 1) x (1 + 2 + 3): 1.5 x 6.
    for (const float p : state.gather_parameters()) RANK_CHECK(p == -9.0f, p);
  });
}

TEST_CASE("ddp: a region a rank leaves unmarked contributes zeros, whichever rank skips it, step by step",
          "[training_state][ddp][gloo]") {
  const int world = 2;
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    const auto regions = one_per_layer(4, 8);
    cohort::training_state<cohort::gloo> state{pg, regions, sgd_at_lr_one(32)};
    state.load_parameters(std::vector<float>(32, 0.0f));
    std::vector<float> before(32, 0.0f);
    // Step 0: rank 1 skips region 1. Step 1: rank 0 skips region 2. Step 2: both mark everything.
    for (int step = 0; step < 3; ++step) {
      const std::size_t skipped = step == 0 ? 1 : 2;
      const bool skips = (step == 0 && rank == 1) || (step == 1 && rank == 0);
      for (std::size_t r = regions.size(); r-- > 0;) {
        if (skips && r == skipped) continue;  // neither written nor marked
        for (auto& g : state.gradient(r)) g = 4.0f * static_cast<float>(rank + 1);
        state.mark_ready(r);
      }
      state.step();
      const auto after = state.gather_parameters();
      for (std::size_t r = 0; r < regions.size(); ++r) {
        // Only the other rank's gradient, halved, where one rank skipped; else (4 + 8) / 2.
        const float other = 4.0f * static_cast<float>(step == 0 ? 1 : 2);
        const float want = step < 2 && r == skipped ? other / 2 : 6.0f;
        const float got = before[regions[r].offset] - after[regions[r].offset];
        RANK_CHECK(got == want, "step " << step << " region " << r << ": " << got << " != " << want);
      }
      before = after;
    }
  });
}

TEST_CASE("ddp: every rank gets the norm of the averaged gradients and clips as clip_grad_norm_",
          "[training_state][ddp][gloo]") {
  const int world = 3;
  const std::vector<std::size_t> sizes{33, 5, 200};
  const auto value = [](int rank, std::size_t tensor, std::size_t i) {
    return std::cos(0.3f * static_cast<float>(i + 7 * tensor)) * static_cast<float>(rank + 1);
  };
  double squares = 0;  // the norm of the average, in double
  for (std::size_t t = 0; t < sizes.size(); ++t)
    for (std::size_t i = 0; i < sizes[t]; ++i) {
      double mean = 0;
      for (int r = 0; r < world; ++r) mean += value(r, t, i);
      mean /= world;
      squares += mean * mean;
    }
  const double norm = std::sqrt(squares);
  std::vector<region> regions;
  for (std::size_t t = 0, at = 0; t < sizes.size(); at += sizes[t++])
    regions.push_back({"t" + std::to_string(t), at, sizes[t], t});
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    for (const double max_norm : {norm / 4, 10 * norm}) {
      auto options = sgd_at_lr_one(std::size_t{25} << 20);
      options.max_grad_norm = max_norm;
      cohort::training_state<cohort::gloo> state{pg, regions, options};
      state.load_parameters(std::vector<float>(238, 0.0f));
      for (std::size_t t = sizes.size(); t-- > 0;) {
        auto g = state.gradient(t);
        for (std::size_t i = 0; i < g.size(); ++i) g[i] = value(rank, t, i);
        state.mark_ready(t);
      }
      const auto result = state.step();
      RANK_CHECK(std::abs(result.grad_norm - norm) <= 1e-5 * norm, "norm " << result.grad_norm << " vs " << norm);
      if (max_norm < norm) {
        // PyTorch's factor: max / (norm + 1e-6); after it the gradients' norm is the max.
        RANK_CHECK(std::abs(result.clip_factor - max_norm / (result.grad_norm + 1e-6)) <= 1e-12);
        double applied = 0;
        for (const float p : state.gather_parameters()) applied += static_cast<double>(p) * p;
        RANK_CHECK(std::abs(std::sqrt(applied) - max_norm) <= 1e-5 * max_norm, "after " << std::sqrt(applied));
      } else {
        RANK_CHECK(result.clip_factor == 1.0);  // a bound above the norm leaves the gradients alone
      }
    }
  });
}

TEST_CASE("ddp: an inf in any rank's share of the measured gradients skips the step on every rank, counted once",
          "[training_state][ddp][gloo][faults]") {
  // Each rank measures 1/N of every bucket (the remainder in rank 0's share) and the shares
  // are summed: an inf wherever it lands is seen by exactly one rank and reaches every rank.
  // 3 ranks, one bucket of 238 elements: chunks of 79 at 0, 79 and 158, the remainder 237.
  const int world = 3;
  const std::vector<std::size_t> sizes{33, 5, 200};
  std::vector<region> regions;
  for (std::size_t t = 0, at = 0; t < sizes.size(); at += sizes[t++])
    regions.push_back({"t" + std::to_string(t), at, sizes[t], t});
  const std::vector<std::size_t> positions{0, 78, 79, 157, 158, 236, 237};
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    auto options = sgd_at_lr_one(std::size_t{25} << 20);
    options.max_grad_norm = 1.0;
    cohort::training_state<cohort::gloo> state{pg, regions, options};
    state.load_parameters(std::vector<float>(238, 0.0f));
    RANK_CHECK(state.bucket_count() == 1);
    for (std::size_t step = 0; step <= positions.size(); ++step) {
      // One rank, a different one each step, writes the inf; the last step has none.
      const bool poisoned = step < positions.size() && static_cast<int>(step % world) == rank;
      for (std::size_t t = sizes.size(); t-- > 0;) {
        auto g = state.gradient(t);
        for (std::size_t i = 0; i < g.size(); ++i) {
          const std::size_t e = regions[t].offset + i;
          g[i] = poisoned && e == positions[step] ? std::numeric_limits<float>::infinity() : 0.25f;
        }
        state.mark_ready(t);
      }
      const auto result = state.step();
      if (step < positions.size()) {
        RANK_CHECK(result.skipped, "the inf at element " << positions[step] << " was missed");
        RANK_CHECK(result.nonfinite == 1, "element " << positions[step] << ": counted " << result.nonfinite);
        RANK_CHECK(std::isnan(result.grad_norm));
      } else {
        RANK_CHECK(!result.skipped);
        RANK_CHECK(result.nonfinite == 0);
        RANK_CHECK(std::abs(result.grad_norm - 0.25 * std::sqrt(238.0)) <= 1e-12, "norm " << result.grad_norm);
      }
    }
    // The skipped steps left the parameters alone; the last one applied its clipped gradient.
    const auto params = state.gather_parameters();
    const float want = -static_cast<float>(0.25 * (1.0 / (0.25 * std::sqrt(238.0) + 1e-6)));
    for (std::size_t e = 0; e < params.size(); ++e)
      RANK_CHECK(std::abs(params[e] - want) <= 1e-6f, "element " << e << ": " << params[e] << " vs " << want);
  });
}

TEST_CASE("ddp: bfloat16 gradients are communicated in bfloat16, exact where bfloat16 is",
          "[training_state][ddp][gloo]") {
  const int world = 2;
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    const auto regions = one_per_layer(2, 100);
    cohort::training_state<cohort::gloo, float, cohort::bfloat16> state{pg, regions, sgd_at_lr_one(256)};
    state.load_parameters(std::vector<float>(200, 0.0f));
    for (std::size_t r = 2; r-- > 0;) {
      auto g = state.gradient(r);
      // Small integers and halves: exact in bfloat16, as their averages are.
      for (std::size_t i = 0; i < g.size(); ++i)
        g[i] = cohort::bfloat16(0.5f * static_cast<float>(i % 13) * static_cast<float>(rank + 1));
      state.mark_ready(r);
    }
    state.step();
    const auto params = state.gather_parameters();
    for (std::size_t e = 0; e < params.size(); ++e)
      RANK_CHECK(params[e] == -0.75f * static_cast<float>(e % 100 % 13), "element " << e << ": " << params[e]);
  });
}

TEST_CASE("ranks that pass different initial parameters start from rank 0's where they hold them whole",
          "[training_state][ddp][gloo]") {
  const int world = 3;
  for (const strategy kind : {strategy::ddp, strategy::zero1, strategy::zero2}) {
    auto store = std::make_shared<cohort::memory_store>();
    cohort_test::run_ranks(world, [&](int rank) {
      auto pg = cohort_test::make_gloo_group(store, rank, world);
      const auto regions = one_per_layer(3, 10);
      cohort::training_state<cohort::gloo> state{pg, regions, {.strategy = kind}};
      state.load_parameters(std::vector<float>(30, static_cast<float>(rank + 1)));  // another seed per rank
      for (std::size_t l = 0; l < regions.size(); ++l) {
        const auto layer = state.gather(l);
        for (const float p : layer.param(l)) RANK_CHECK(p == 1.0f, cohort::to_string(kind) << ": " << p);
      }
    });
  }
}

TEST_CASE("hybrid copies given different initial parameters all start from the first copy's",
          "[training_state][gloo][hybrid]") {
  // 2 x 2: groups {0, 1} and {2, 3}, replicas {0, 2} and {1, 3}; each rank another seed. Every
  // strategy, zero3 included: each shard comes from the first copy's holder of that shard.
  for (const strategy kind : {strategy::ddp, strategy::zero1, strategy::zero2, strategy::zero3}) {
    auto store = std::make_shared<cohort::memory_store>();
    cohort_test::run_ranks(4, [&](int rank) {
      auto pg = cohort_test::make_gloo_group(store, rank, 4);
      auto shards = pg.split(rank / 2, rank);
      auto replicas = pg.split(rank % 2, rank);
      const auto regions = one_per_layer(3, 10);
      cohort::training_state<cohort::gloo> state{*shards, regions, {.strategy = kind}, &*replicas};
      std::vector<float> mine(30);
      for (std::size_t e = 0; e < mine.size(); ++e) mine[e] = static_cast<float>(100 * rank) + static_cast<float>(e);
      state.load_parameters(mine);
      for (std::size_t l = 0; l < regions.size(); ++l) {
        const auto layer = state.gather(l);
        const auto p = layer.param(l);
        for (std::size_t e = 0; e < p.size(); ++e) {
          // ddp/zero1/zero2: rank 0's everywhere; zero3: each element from the first copy's
          // holder of its shard (rank 0 or 1), never from the second copy (ranks 2, 3).
          const float seed0 = static_cast<float>(10 * l + e);
          const bool first_copy = p[e] == seed0 || p[e] == seed0 + 100.0f;
          RANK_CHECK(kind == strategy::zero3 ? first_copy : p[e] == seed0,
                     cohort::to_string(kind) << ": layer " << l << " element " << e << " = " << p[e]);
        }
      }
    });
  }
}

TEST_CASE("ddp misuse names the rank and the region: marked twice in one step, or dtypes that differ across ranks",
          "[training_state][ddp][gloo][faults]") {
  const int world = 2;
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    const auto regions = one_per_layer(3, 16);
    cohort::training_state<cohort::gloo> state{pg, regions, sgd_at_lr_one(64)};
    state.load_parameters(std::vector<float>(48, 0.0f));
    state.mark_ready(2);
    RANK_CHECK_THROWS(cohort::error, state.mark_ready(2),
                      "[rank " + std::to_string(rank) + "] training_state.mark_ready: region 2 't2' marked twice");
    // The step goes on: nothing was launched twice.
    state.mark_ready(1);
    state.mark_ready(0);
    state.step();
  });

  std::vector<std::string> errors(world);
  store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    const auto regions = one_per_layer(3, 16);
    try {
      if (rank == 1) {
        cohort::training_state<cohort::gloo, double> doubles{pg, regions};
      } else {
        cohort::training_state<cohort::gloo, float> floats{pg, regions};
      }
    } catch (const cohort::error& e) {
      errors[static_cast<std::size_t>(rank)] = e.what();
    }
  });
  for (const auto& text : errors)
    CHECK_THAT(text, Catch::Contains("rank 1 has 3 regions over 48 elements, rank 0 3 over 48 (the same sizes: their "
                                     "offsets, layers, strategy, bucket_bytes or dtypes differ)"));
}

TEST_CASE("buckets fill in the backward's order, the first to launch closing at first_bucket_bytes, as DDP's",
          "[training_state][ddp]") {
  // Five layers of 10 floats, adjacent. A cap of 30 and a first bucket of 15: the last two
  // layers launch first, together (they reach 15), and the other three follow in one bucket.
  const auto five = one_per_layer(5, 10);
  const auto small_first = cohort::detail::plan_layout(five, 2, 30, true, 15);
  REQUIRE(small_first.buckets.size() == 2);
  CHECK(small_first.buckets[1].regions == std::vector<std::size_t>({3, 4}));  // launches first
  CHECK(small_first.buckets[0].regions == std::vector<std::size_t>({0, 1, 2}));
  // Without a first bucket of its own (0, or one at least the cap), the last to launch holds
  // what is left over, as DDP's last bucket does.
  for (const std::size_t first : {std::size_t{0}, std::size_t{30}, std::size_t{1000}}) {
    const auto even = cohort::detail::plan_layout(five, 2, 30, true, first);
    REQUIRE(even.buckets.size() == 2);
    CHECK(even.buckets[1].regions == std::vector<std::size_t>({2, 3, 4}));
    CHECK(even.buckets[0].regions == std::vector<std::size_t>({0, 1}));
  }
  // A first bucket smaller than the last layer's region still holds that region whole: it
  // closes once it holds the target. Here the classifier of a ResNet-50 (2,048,000 + 1,000
  // floats) against DDP's 1 MiB: the first bucket is the classifier, as DDP's is.
  std::vector<region> resnet_tail{
      {"layer4.2.bn3.bias", 0, 2048, 0}, {"fc.weight", 2048, 2048000, 1}, {"fc.bias", 2050048, 1000, 2}};
  const auto tail = cohort::detail::plan_layout(resnet_tail, 2, (std::size_t{25} << 20) / 4, true, (1u << 20) / 4);
  REQUIRE(tail.buckets.size() == 2);
  CHECK(tail.buckets[1].regions == std::vector<std::size_t>({1, 2}));
  CHECK(tail.buckets[1].elements == 2049000);
  // Layers stay whole while they fit: two layers of two regions (6 + 6 floats) under a cap of
  // 16 are two buckets, not 16 + 8; a layer past the cap is cut between its regions.
  const std::vector<region> pairs{{"a0", 0, 6, 0}, {"b0", 6, 6, 0}, {"a1", 12, 6, 1}, {"b1", 18, 6, 1}};
  const auto whole = cohort::detail::plan_layout(pairs, 1, 16, true, 16);
  REQUIRE(whole.buckets.size() == 2);
  CHECK(whole.buckets[1].regions == std::vector<std::size_t>({2, 3}));
  const auto cut = cohort::detail::plan_layout(pairs, 1, 10, true);
  CHECK(cut.buckets.size() == 4);
  // The state's default is DDP's: a 1 MiB first bucket under 25 MiB buckets.
  CHECK(cohort::training_options{}.first_bucket_bytes == std::size_t{1} << 20);
  CHECK(cohort::training_options{}.bucket_bytes == std::size_t{25} << 20);
}

TEST_CASE("the bucketing rule: regions fill a bucket up to bucket_bytes, and a larger region has one of its own",
          "[training_state][ddp]") {
  // Floats in six layers, adjacent in the buffer; a cap of 500 elements (2000 bytes).
  const std::vector<std::size_t> sizes{100, 4, 300, 8, 2000, 4};
  std::vector<region> regions;
  for (std::size_t t = 0, at = 0; t < sizes.size(); at += sizes[t++])
    regions.push_back({"t" + std::to_string(t), at, sizes[t], t});
  const auto layout = cohort::detail::plan_layout(regions, 1, 500, true);
  REQUIRE(layout.buckets.size() == 3);
  CHECK(layout.buckets[0].regions == std::vector<std::size_t>({0, 1, 2, 3}));  // 100 + 4 + 300 + 8 <= 500
  CHECK(layout.buckets[1].regions == std::vector<std::size_t>({4}));           // over the cap: alone
  CHECK(layout.buckets[2].regions == std::vector<std::size_t>({5}));
  CHECK(layout.buckets[0].elements == 412);     // no padding: the trainer's buffer is not cohort's to pad
  CHECK(layout.buckets[0].ranges.size() == 1);  // adjacent regions: one call
  // At 3 ranks each range is 3 equal chunks and a remainder of fewer than 3 elements.
  for (const auto& bucket : cohort::detail::plan_layout(regions, 3, 500, true).buckets)
    for (const auto& range : bucket.ranges) {
      CHECK(range.chunk == range.count / 3);
      CHECK(range.remainder == range.count % 3);
    }
}
