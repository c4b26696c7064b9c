// The global gradient norm and clipping (cohort/clip.hpp) on a reducer and on sharded
// parameters, the loss scaler's schedule, and per-unit weight decay: Gloo ranks as threads,
// whose gradients differ by rank, against norms computed here from every rank's values.
#include <catch2/catch.hpp>

#include <cohort/backend/gloo.hpp>
#include <cohort/clip.hpp>
#include <cohort/detail/scalar_math.hpp>
#include <cohort/loss_scaler.hpp>
#include <cohort/optim.hpp>
#include <cohort/store.hpp>

#include <chrono>
#include <cmath>
#include <limits>
#include <vector>

#include "flat_fixtures.hpp"
#include "support.hpp"

namespace {

float value(int rank, std::size_t tensor, std::size_t i) {
  return std::cos(0.3f * static_cast<float>(i + 7 * tensor)) * static_cast<float>(rank + 1);
}

// The norm of the average over ranks of value(r, t, i), in double.
double expected_norm(int world, const std::vector<std::size_t>& sizes) {
  double squares = 0;
  for (std::size_t t = 0; t < sizes.size(); ++t)
    for (std::size_t i = 0; i < sizes[t]; ++i) {
      double mean = 0;
      for (int r = 0; r < world; ++r) mean += value(r, t, i);
      mean /= world;
      squares += mean * mean;
    }
  return std::sqrt(squares);
}

}  // namespace

// The norms above and Adam's update use detail/scalar_math.hpp's builtins in place of <cmath>:
// the same values, bit for bit, including at the edges.
TEST_CASE("scalar_math's builtins give what <cmath> gives", "[clip]") {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double denormal = std::numeric_limits<double>::denorm_min();
  for (double x : {0.0, -0.0, denormal, 1e-300, 0.5, 2.0, 3.0, 1e300, inf, -1.0, -inf, nan}) {
    const double root = cohort::detail::square_root(x);
    if (std::isnan(std::sqrt(x)))
      CHECK(std::isnan(root));
    else
      CHECK(root == std::sqrt(x));
    const auto single = static_cast<float>(x);
    const float single_root = cohort::detail::square_root(single);
    if (std::isnan(std::sqrt(single)))
      CHECK(std::isnan(single_root));
    else
      CHECK(single_root == std::sqrt(single));
    CHECK(cohort::detail::is_finite(x) == std::isfinite(x));
    CHECK(cohort::detail::is_finite(single) == std::isfinite(single));
  }
  for (double beta : {0.9, 0.999, 0.5})
    for (double t : {1.0, 2.0, 10.0, 1000.0, 1e6}) CHECK(cohort::detail::power(beta, t) == std::pow(beta, t));
  CHECK(std::isnan(cohort::detail::quiet_nan()));
}

TEST_CASE("clip_grad_norm on a reducer: every rank gets the norm of the average and clips alike",
          "[clip][reducer][gloo]") {
  const int world = 3;
  const std::vector<std::size_t> sizes{33, 5, 200};
  const double norm = expected_norm(world, sizes);
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    cohort::gradient_reducer<cohort::gloo> ddp{pg, sizes};
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      auto g = ddp.gradient(t);
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = value(rank, t, i);
    }
    for (std::size_t t = sizes.size(); t-- > 0;) ddp.mark_ready(t);
    ddp.finish();
    const double max_norm = norm / 4;
    const auto clipped = cohort::clip_grad_norm(ddp, max_norm);
    RANK_CHECK(std::abs(clipped.grad_norm - norm) <= 1e-5 * norm, "norm " << clipped.grad_norm << " vs " << norm);
    RANK_CHECK(std::abs(clipped.clip_factor - max_norm / (clipped.grad_norm + 1e-6)) <= 1e-12);
    // After clipping the norm is max_norm (to float precision).
    const double after = cohort::global_grad_norm(ddp);
    RANK_CHECK(std::abs(after - max_norm) <= 1e-5 * max_norm, "after " << after);
    // A bound above the norm leaves the gradients alone.
    const auto untouched = cohort::clip_grad_norm(ddp, 10 * norm);
    RANK_CHECK(untouched.clip_factor == 1.0);
  });
}

TEST_CASE("global_grad_norm over sharded parameters sums the shards and counts replicated units once",
          "[clip][sharded][gloo]") {
  const int world = 3;
  // Unit 0 (4 elements) is replicated (below replicate_below), units 1 and 2 are sharded,
  // 100 elements padding to 102 on 3 ranks.
  const std::vector<std::vector<std::size_t>> units{{4}, {60, 40}, {30}};
  const std::vector<std::size_t> flat{4, 100, 30};
  const double norm = expected_norm(world, flat);
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    cohort::sharded_parameters<cohort::gloo, float> params{pg, units, {.replicate_below = 8}};
    RANK_CHECK(params.replicated(0) && !params.replicated(1));
    for (std::size_t u = 0; u < flat.size(); ++u) {
      std::vector<float> gradient(flat[u]);
      for (std::size_t i = 0; i < gradient.size(); ++i) gradient[i] = value(rank, u, i);
      params.reduce_scatter_grad(u, gradient).wait();
    }
    const auto clipped = cohort::clip_grad_norm(params, norm / 2);
    RANK_CHECK(std::abs(clipped.grad_norm - norm) <= 1e-5 * norm, "norm " << clipped.grad_norm << " vs " << norm);
    RANK_CHECK(std::abs(clipped.clip_factor - 0.5) <= 1e-5);

    // Per-unit weight decay: with zero gradients only the decaying unit moves.
    cohort::sharded_parameters<cohort::gloo, float> weights{pg, {{16}, {16}}};
    for (std::size_t u = 0; u < 2; ++u) {
      auto shard = weights.shard(u);
      std::fill(shard.begin(), shard.end(), 1.0f);
      std::vector<float> zero(16, 0.0f);
      weights.reduce_scatter_grad(u, zero).wait();
    }
    cohort::adam opt{weights, {.lr = 0.1, .weight_decay = 0.5}, {1, 0}};
    opt.step().wait();
    for (float w : weights.shard(0)) RANK_CHECK(std::abs(w - 0.95f) <= 1e-6f, "decayed " << w);
    for (float w : weights.shard(1)) RANK_CHECK(w == 1.0f, "not decayed " << w);
  });
}

TEST_CASE("the loss scaler backs off on a skipped step and grows after an interval of good ones", "[clip]") {
  cohort::loss_scaler scaler({.initial_scale = 1024, .growth_factor = 2, .backoff_factor = 0.5, .growth_interval = 3});
  CHECK(scaler.scale() == 1024);
  CHECK(scaler.update(true));  // skipped
  CHECK(scaler.scale() == 512);
  CHECK_FALSE(scaler.update(false));
  CHECK_FALSE(scaler.update(false));
  CHECK(scaler.scale() == 512);
  CHECK_FALSE(scaler.update(false));  // the third good step in a row
  CHECK(scaler.scale() == 1024);
  CHECK(scaler.skipped_steps() == 1);
  cohort::loss_scaler floor({.initial_scale = 2, .min_scale = 1});
  floor.update(true);
  floor.update(true);
  CHECK(floor.scale() == 1);
  CHECK_THROWS_WITH(cohort::loss_scaler({.initial_scale = 0}), Catch::Contains("need initial > 0"));
}
