// zero_optimizer (ZeRO stages 1 and 2) on Gloo ranks as threads, over a flat buffer laid out
// as llm.c lays its parameters out, against a single-process AdamW computed here in double:
// averaged gradients, a global norm clipped to a bound, per-tensor weight decay and a dynamic
// loss scale whose skipped step (an inf on one rank only) is skipped by every rank.
#include <catch2/catch.hpp>

#include <cohort/backend/gloo.hpp>
#include <cohort/store.hpp>
#include <cohort/zero.hpp>

#include <chrono>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "flat_fixtures.hpp"
#include "support.hpp"

namespace {

using cohort_test::stacked_model;

float initial_parameter(std::size_t e) { return 0.1f * static_cast<float>(e % 11) - 0.5f; }
// Rank r's unscaled gradient at step s: varied signs and sizes, so clipping bites.
float gradient(int rank, int step, std::size_t e) {
  return std::sin(0.37f * static_cast<float>(e) + 0.9f * static_cast<float>(step) + static_cast<float>(rank)) *
         (1.0f + static_cast<float>(rank));
}
constexpr int inf_step = 2;  // rank 1 produces an inf at this step: every rank must skip it
constexpr int inf_rank = 1;
constexpr int steps = 5;

struct settings {
  // eps large next to the gradients: Adam is otherwise blind to their scale, and the test
  // must see clipping and unscaling.
  double lr = 0.05, beta1 = 0.9, beta2 = 0.99, eps = 0.05, weight_decay = 0.1, max_norm = 0.5;
  double initial_scale = 1024;
};

// The same training on one process, in double: the reference.
std::vector<double> reference(int world, const stacked_model& model, const settings& s) {
  const std::size_t n = model.elements();
  std::vector<double> p(n), m(n, 0.0), v(n, 0.0);
  for (std::size_t e = 0; e < n; ++e) p[e] = initial_parameter(e);
  std::vector<bool> decays(n, false);
  const auto regions = model.regions();
  const auto flags = model.decay();
  for (std::size_t i = 0; i < regions.size(); ++i)
    for (std::size_t e = 0; e < regions[i].count; ++e) decays[regions[i].offset + e] = flags[i] != 0;
  int t = 0;
  for (int step = 0; step < steps; ++step) {
    if (step == inf_step) continue;  // skipped on every rank (the gradients' scale cancels out)
    std::vector<double> g(n, 0.0);
    double squares = 0;
    for (std::size_t e = 0; e < n; ++e) {
      for (int r = 0; r < world; ++r) g[e] += gradient(r, step, e);
      g[e] /= world;
      squares += g[e] * g[e];
    }
    const double norm = std::sqrt(squares);
    const double clip = norm > s.max_norm ? s.max_norm / (norm + 1e-6) : 1.0;
    ++t;
    for (std::size_t e = 0; e < n; ++e) {
      const double grad = g[e] * clip;
      m[e] = s.beta1 * m[e] + (1 - s.beta1) * grad;
      v[e] = s.beta2 * v[e] + (1 - s.beta2) * grad * grad;
      const double mh = m[e] / (1 - std::pow(s.beta1, t)), vh = v[e] / (1 - std::pow(s.beta2, t));
      p[e] -= s.lr * (mh / (std::sqrt(vh) + s.eps) + (decays[e] ? s.weight_decay : 0.0) * p[e]);
    }
  }
  return p;
}

void train(int world, int stage) {
  const stacked_model model;
  const settings s;
  const auto expected = reference(world, model, s);
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    std::vector<float> params(model.elements()), grads(model.elements());
    for (std::size_t e = 0; e < params.size(); ++e) params[e] = initial_parameter(e);
    cohort::loss_scaler scaler({.initial_scale = s.initial_scale, .growth_interval = 1000});
    // 24-byte buckets (6 floats): many buckets, most with a replicated remainder at 4 ranks.
    cohort::zero_optimizer<cohort::gloo, float> zero{
        pg,
        std::span<float>(params),
        std::span<float>(grads),
        model.regions(),
        {.stage = stage,
         .bucket_bytes = 24,
         .adam = {.lr = s.lr, .beta1 = s.beta1, .beta2 = s.beta2, .eps = s.eps, .weight_decay = s.weight_decay},
         .max_grad_norm = s.max_norm,
         .decay = model.decay(),
         .scaler = &scaler}};
    RANK_CHECK(zero.bucket_count() == 7);
    // Each rank owns 1/N of every bucket (plus its replicated remainder): state is 1/N.
    const std::size_t whole = model.elements();
    RANK_CHECK(zero.owned_elements() * static_cast<std::size_t>(world) <=
                   whole + zero.bucket_count() * static_cast<std::size_t>(world * (world - 1)),
               "owned " << zero.owned_elements());
    RANK_CHECK(zero.optimizer_state_bytes() == 3 * zero.owned_elements() * sizeof(float));
    for (int step = 0; step < steps; ++step) {
      const double loss_scale = scaler.scale();
      for (std::size_t e = 0; e < grads.size(); ++e)
        grads[e] = static_cast<float>(gradient(rank, step, e) * loss_scale);
      if (step == inf_step && rank == inf_rank) grads[3] = std::numeric_limits<float>::infinity();
      // Backward: last layer first; rank 2 marks each layer's two tensors the other way round.
      const std::size_t regions = model.regions().size();
      for (std::size_t l = model.layers; l-- > 0;) {
        const std::size_t a = 1 + 2 * l, b = 2 + 2 * l;
        zero.mark_ready(rank == 2 ? a : b);
        zero.mark_ready(rank == 2 ? b : a);
      }
      zero.mark_ready(0);
      RANK_CHECK(regions == 1 + 2 * model.layers);
      const auto result = zero.step();
      RANK_CHECK(result.skipped == (step == inf_step), "step " << step);
      RANK_CHECK(result.loss_scale == loss_scale);
      if (!result.skipped) RANK_CHECK(result.clip_factor < 1.0, "the norm " << result.grad_norm << " is not clipped");
      zero.parameters_ready().wait();
    }
    RANK_CHECK(scaler.skipped_steps() == 1);
    RANK_CHECK(zero.steps() == steps - 1);
    for (std::size_t e = 0; e < params.size(); ++e)
      RANK_CHECK(std::abs(params[e] - expected[e]) <= 1e-5 * std::max(1.0, std::abs(expected[e])),
                 "element " << e << ": " << params[e] << " vs " << expected[e]);
  });
}

}  // namespace

TEST_CASE("ZeRO-1 equals single-process AdamW with clipping, decay and a skipped step, at 2, 3 and 4 ranks",
          "[zero][gloo]") {
  for (int world : {2, 3, 4}) {
    INFO("world " << world);
    train(world, 1);
  }
}

TEST_CASE("ZeRO-2 (buckets reduce-scattered during the backward) equals the same, at 2, 3 and 4 ranks",
          "[zero][gloo]") {
  for (int world : {2, 3, 4}) {
    INFO("world " << world);
    train(world, 2);
  }
}

TEST_CASE("ZeRO-2 launches a bucket as soon as its last region is marked", "[zero][gloo]") {
  auto store = std::make_shared<cohort::memory_store>();
  auto pg = cohort_test::make_gloo_group(store, 0, 1);
  std::vector<float> params(12, 1.0f), grads(12, 0.0f);
  // Two regions, one bucket each (24 bytes).
  cohort::zero_optimizer<cohort::gloo, float> zero{
      pg, std::span<float>(params), std::span<float>(grads), {{0, 6}, {6, 6}}, {.stage = 2, .bucket_bytes = 24}};
  REQUIRE(zero.bucket_count() == 2);
  REQUIRE(zero.wire_bytes_per_step() == 0);  // one rank moves nothing
  zero.mark_ready(1);
  zero.mark_ready(0);
  const auto result = zero.step();
  CHECK_FALSE(result.skipped);
  zero.parameters_ready().wait();
  REQUIRE_THROWS_WITH(zero.step(), Catch::Contains("2 region(s) never marked ready"));
}

TEST_CASE("ZeRO: a rank with another layout is refused on every rank, and bad regions are named",
          "[zero][gloo][faults]") {
  const int world = 2;
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::string> messages(world);
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    std::vector<float> params(16), grads(16);
    try {
      cohort::zero_optimizer<cohort::gloo, float> zero{
          pg, std::span<float>(params), std::span<float>(grads), {{0, 16}}, {.bucket_bytes = rank == 1 ? 32u : 64u}};
      throw cohort_test::rank_failure("mismatched layouts accepted");
    } catch (const cohort::error& failure) {
      messages[static_cast<std::size_t>(rank)] = failure.what();
    }
  });
  for (const auto& text : messages) CHECK_THAT(text, Catch::Contains("rank 1 has another layout than rank 0"));

  auto single = cohort_test::make_gloo_group(store, 0, 1);
  std::vector<float> params(10), grads(10);
  REQUIRE_THROWS_WITH((cohort::zero_optimizer<cohort::gloo, float>{
                          single, std::span<float>(params), std::span<float>(grads), {{0, 6}, {4, 6}}}),
                      Catch::Contains("overlap"));
  REQUIRE_THROWS_WITH((cohort::zero_optimizer<cohort::gloo, float>{
                          single, std::span<float>(params), std::span<float>(grads).first(9), {{0, 6}}}),
                      Catch::Contains("10 parameters but 9 gradients"));
}

TEST_CASE("ZeRO over bfloat16 parameters keeps fp32 masters and matches the fp32 run to bfloat16 precision",
          "[zero][gloo]") {
  const int world = 2;
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    const std::size_t n = 40;
    std::vector<cohort::bfloat16> params(n), grads(n);
    std::vector<float> params32(n), grads32(n);
    for (std::size_t e = 0; e < n; ++e) {
      params32[e] = initial_parameter(e);
      params[e] = cohort::bfloat16(params32[e]);
      params32[e] = static_cast<float>(params[e]);  // both start from the same rounded values
    }
    const cohort::zero_options options{.stage = 2, .bucket_bytes = 32, .adam = {.lr = 0.01}};
    cohort::zero_optimizer<cohort::gloo, cohort::bfloat16> low{
        pg, std::span<cohort::bfloat16>(params), std::span<cohort::bfloat16>(grads), {{0, n}}, options};
    cohort::zero_optimizer<cohort::gloo, float> full{pg,
                                                     std::span<float>(params32),
                                                     std::span<float>(grads32),
                                                     {{0, n}},
                                                     {.stage = 2, .bucket_bytes = 64, .adam = {.lr = 0.01}}};
    for (int step = 0; step < 3; ++step) {
      for (std::size_t e = 0; e < n; ++e) {
        grads32[e] = static_cast<float>(cohort::bfloat16(gradient(rank, step, e)));
        grads[e] = cohort::bfloat16(grads32[e]);
      }
      low.mark_ready(0);
      full.mark_ready(0);
      low.step();
      full.step();
      low.parameters_ready().wait();
      full.parameters_ready().wait();
    }
    // The masters carry fp32 precision between steps: only the final rounding to bfloat16
    // (and the bfloat16 average of the gradients) differs from the fp32 run.
    for (std::size_t e = 0; e < n; ++e)
      RANK_CHECK(std::abs(static_cast<float>(params[e]) - params32[e]) <= 1e-2f * std::max(1.0f, std::abs(params32[e])),
                 "element " << e << ": " << static_cast<float>(params[e]) << " vs " << params32[e]);
  });
}
