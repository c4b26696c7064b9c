// ZeRO-1 and ZeRO-2 through training_state, with what zero_optimizer's tests pinned before it
// was removed (training_state's zero1 and zero2 are the one design now): float parameters in
// llm.c's stacked layout against a single-process AdamW in double, with clipping, per-tensor
// weight decay and an inf on one rank only that every rank skips; a bucket launched as soon as
// its last region is marked; a rank with another bucket size refused on every rank; overlapping
// regions and a parameter buffer of the wrong size refused, naming them; the bucket buffer
// pool's choice of a buffer whose last use is done.
#include <catch2/catch.hpp>

#include <cohort/parallel/training_state.hpp>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "flat_fixtures.hpp"
#include "support.hpp"

namespace {

using cohort::region;
using cohort::strategy;

// flat_fixtures' stacked model: region 1 + l is a_l, 5 + l is b_l.
using cohort_test::element_count;
using cohort_test::stacked_model;
constexpr std::size_t layers = cohort_test::stacked_layers;

float initial_parameter(std::size_t e) { return 0.1f * static_cast<float>(e % 11) - 0.5f; }
// Rank r's unscaled gradient at step s: varied signs and sizes, so clipping bites.
float gradient(int rank, int step, std::size_t e) {
  return std::sin(0.37f * static_cast<float>(e) + 0.9f * static_cast<float>(step) + static_cast<float>(rank)) *
         (1.0f + static_cast<float>(rank));
}
constexpr int inf_step = 2;  // rank 1 alone produces an inf at this step: every rank must skip it
constexpr int inf_rank = 1;
constexpr int steps = 5;

// eps large next to the gradients: Adam is otherwise blind to their scale, and the test must
// see clipping and unscaling.
constexpr cohort::adam_options adam{.lr = 0.05, .beta1 = 0.9, .beta2 = 0.99, .eps = 0.05, .weight_decay = 0.1};
constexpr double max_norm = 0.5;

// The same training on one process, in double, over its first `upto` steps: the reference.
std::vector<double> reference(int world, int upto = steps) {
  const auto regions = stacked_model();
  const std::size_t n = element_count(regions);
  std::vector<double> p(n), m(n, 0.0), v(n, 0.0);
  for (std::size_t e = 0; e < n; ++e) p[e] = initial_parameter(e);
  int t = 0;
  for (int step = 0; step < upto; ++step) {
    if (step == inf_step) continue;  // skipped on every rank (the gradients' scale cancels out)
    std::vector<double> g(n, 0.0);
    double squares = 0;
    for (std::size_t e = 0; e < n; ++e) {
      for (int r = 0; r < world; ++r) g[e] += gradient(r, step, e);
      g[e] /= world;
      squares += g[e] * g[e];
    }
    const double norm = std::sqrt(squares);
    const double clip = norm > max_norm ? max_norm / (norm + 1e-6) : 1.0;
    ++t;
    for (const auto& r : regions)
      for (std::size_t e = r.offset; e < r.offset + r.count; ++e) {
        const double grad = g[e] * clip;
        m[e] = adam.beta1 * m[e] + (1 - adam.beta1) * grad;
        v[e] = adam.beta2 * v[e] + (1 - adam.beta2) * grad * grad;
        const double mh = m[e] / (1 - std::pow(adam.beta1, t)), vh = v[e] / (1 - std::pow(adam.beta2, t));
        p[e] -= adam.lr * (mh / (std::sqrt(vh) + adam.eps) + (r.decay ? adam.weight_decay : 0.0) * p[e]);
      }
  }
  return p;
}

// The regions of layer l: the embedding alone, then a_l and b_l.
std::vector<std::size_t> regions_of(std::size_t l) {
  return l == 0 ? std::vector<std::size_t>{0} : std::vector<std::size_t>{l, l + layers};
}

// With `forward`, each step begins with a forward that reads every parameter through the
// views and compares it with the reference after the steps so far, each rank in another
// order: rank 0 from the first layer (the order the step publishes in), rank 1 from the
// last, rank 2 through views it kept from before the last step. The state's own buffers at
// zero1/zero2 are published while step() returns: a layer's read must wait for its part.
void train(int world, strategy kind, bool forward = false) {
  const auto regions = stacked_model();
  const std::size_t n = element_count(regions);
  const auto expected = reference(world);
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    cohort::loss_scaler scaler({.initial_scale = 1024, .growth_interval = 1000});
    // 24-byte buckets (6 floats): many buckets, each padded to the world.
    cohort::training_state<cohort::gloo, float> state{
        pg,
        regions,
        {.strategy = kind, .bucket_bytes = 24, .adam = adam, .max_grad_norm = max_norm, .scaler = &scaler}};
    std::vector<float> initial(n);
    for (std::size_t e = 0; e < n; ++e) initial[e] = initial_parameter(e);
    state.load_parameters(initial);
    RANK_CHECK(state.bucket_count() > layers, "buckets " << state.bucket_count());
    // Each rank owns 1/N of every padded bucket; float parameters are their own masters, so
    // the optimizer state is Adam's two moments of the shard.
    RANK_CHECK(state.owned_elements() * static_cast<std::size_t>(world) >= n);
    RANK_CHECK(state.owned_elements() * static_cast<std::size_t>(world) < 2 * n + 8 * state.bucket_count() * world);
    RANK_CHECK(state.memory().optimizer_state == 2 * state.owned_elements() * sizeof(float));
    std::vector<decltype(state.gather(0))> kept;  // rank 2's views, from before the step
    for (int step = 0; step < steps; ++step) {
      const double loss_scale = scaler.scale();
      if (forward) {
        const auto now = reference(world, step);
        const auto read = [&](auto& view, std::size_t l) {
          for (const std::size_t r : regions_of(l)) {
            const auto p = view.param(r);
            for (std::size_t j = 0; j < p.size(); ++j) {
              const double want = now[regions[r].offset + j];
              RANK_CHECK(std::abs(p[j] - want) <= 1e-5 * std::max(1.0, std::abs(want)),
                         "step " << step << " layer " << l << " element " << regions[r].offset + j << ": " << p[j]
                                 << " vs " << want);
            }
          }
        };
        if (rank == 2 && !kept.empty()) {
          for (std::size_t l = 0; l <= layers; ++l) read(kept[l], l);
        } else {
          for (std::size_t i = 0; i <= layers; ++i) {
            const std::size_t l = rank == 1 ? layers - i : i;
            auto view = state.gather(l);
            read(view, l);
          }
        }
        if (rank == 2 && kept.empty())
          for (std::size_t l = 0; l <= layers; ++l) kept.push_back(state.gather(l));
      }
      // Backward: last layer first; rank 2 marks each layer's two tensors the other way round.
      for (std::size_t l = layers + 1; l-- > 0;) {
        auto layer = state.gather(l);
        std::vector<std::size_t> mine = regions_of(l);
        std::reverse(mine.begin(), mine.end());
        if (rank == 2) std::reverse(mine.begin(), mine.end());
        for (const std::size_t r : mine) {
          auto g = state.gradient(r);
          for (std::size_t j = 0; j < g.size(); ++j)
            g[j] = static_cast<float>(gradient(rank, step, regions[r].offset + j) * loss_scale);
          if (step == inf_step && rank == inf_rank && r == 0) g[3] = std::numeric_limits<float>::infinity();
          state.mark_ready(r);
        }
      }
      const auto result = state.step();
      RANK_CHECK(result.skipped == (step == inf_step), "step " << step);
      RANK_CHECK(result.loss_scale == loss_scale);
      if (!result.skipped) RANK_CHECK(result.clip_factor < 1.0, "the norm " << result.grad_norm << " is not clipped");
    }
    kept.clear();
    RANK_CHECK(scaler.skipped_steps() == 1);
    RANK_CHECK(state.steps() == steps - 1);
    const auto params = state.gather_parameters();
    for (std::size_t e = 0; e < n; ++e)
      RANK_CHECK(std::abs(params[e] - expected[e]) <= 1e-5 * std::max(1.0, std::abs(expected[e])),
                 "element " << e << ": " << params[e] << " vs " << expected[e]);
  });
}

}  // namespace

TEST_CASE(
    "ZeRO-1 over float parameters equals single-process AdamW with clipping, decay and a step one rank's inf "
    "skips, at 2, 3 and 4 ranks",
    "[training_state][zero][gloo]") {
  for (int world : {2, 3, 4}) {
    INFO("world " << world);
    train(world, strategy::zero1);
  }
}

TEST_CASE("ZeRO-2 (buckets reduce-scattered during the backward) equals the same, at 2, 3 and 4 ranks",
          "[training_state][zero][gloo]") {
  for (int world : {2, 3, 4}) {
    INFO("world " << world);
    train(world, strategy::zero2);
  }
}

TEST_CASE(
    "ZeRO-1 and ZeRO-2 publish while the step returns: the next forward reads the reference through its views, "
    "from either end or through views kept from before the step",
    "[training_state][zero][gloo]") {
  for (const strategy kind : {strategy::zero1, strategy::zero2}) {
    INFO(to_string(kind));
    train(3, kind, true);
  }
}

TEST_CASE(
    "ZeRO-2 launches a bucket as soon as it and every bucket after it are marked, and unmarked regions reduce as zeros",
    "[training_state][zero][gloo]") {
  auto store = std::make_shared<cohort::memory_store>();
  auto pg = cohort_test::make_gloo_group(store, 0, 1);
  std::vector<std::size_t> launches;
  // Two layers of 6 floats, one 24-byte bucket each; buckets launch last to first.
  cohort::training_state<cohort::gloo, float> state{
      pg,
      {{"a", 0, 6, 0}, {"b", 6, 6, 1}},
      {.strategy = strategy::zero2, .bucket_bytes = 24, .on_launch = [&launches](std::size_t b) {
         launches.push_back(b);
       }}};
  state.load_parameters(std::vector<float>(12, 1.0f));
  REQUIRE(state.bucket_count() == 2);
  std::fill_n(state.gradient(0).begin(), 6, 0.5f);
  state.mark_ready(0);  // bucket 0 waits for bucket 1, which the backward completes first
  CHECK(state.launched_buckets() == 0);
  std::fill_n(state.gradient(1).begin(), 6, 0.5f);
  state.mark_ready(1);
  CHECK(state.launched_buckets() == 2);
  CHECK(launches == std::vector<std::size_t>{1, 0});
  auto result = state.step();
  CHECK_FALSE(result.skipped);
  CHECK(result.grad_norm > 0);
  CHECK(state.wire_bytes_per_step() == 0);  // one rank moves nothing
  // zero_optimizer refused a step with regions never marked; training_state reduces what an
  // unmarked region holds, zeros (a rank may leave a region unused), on every rank alike.
  launches.clear();
  result = state.step();
  CHECK_FALSE(result.skipped);
  CHECK(result.grad_norm == 0);
  CHECK(launches == std::vector<std::size_t>{1, 0});
}

TEST_CASE(
    "ZeRO: a rank with another bucket size is refused on every rank, and overlapping regions and a parameter "
    "buffer of the wrong size are named",
    "[training_state][zero][gloo][faults]") {
  const int world = 2;
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::string> messages(world);
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    try {
      cohort::training_state<cohort::gloo, float> state{
          pg, {{"w", 0, 16}}, {.strategy = strategy::zero1, .bucket_bytes = rank == 1 ? 32u : 64u}};
      throw cohort_test::rank_failure("mismatched layouts accepted");
    } catch (const cohort::error& failure) {
      messages[static_cast<std::size_t>(rank)] = failure.what();
    }
  });
  for (const auto& text : messages)
    CHECK_THAT(text, Catch::Contains("rank 1 has 1 regions over 16 elements, rank 0 1 over 16 (the same sizes: "
                                     "their offsets, layers, strategy, bucket_bytes or dtypes differ)"));

  auto single = cohort_test::make_gloo_group(store, 0, 1);
  REQUIRE_THROWS_WITH(
      (cohort::training_state<cohort::gloo, float>{single, {{"a", 0, 6}, {"b", 4, 6}}, {.strategy = strategy::zero2}}),
      Catch::Contains("region 1 'b' (elements 4..10) overlaps region 0 'a' (elements 0..6)"));
  cohort::training_state<cohort::gloo, float> state{single, {{"a", 0, 6}, {"b", 6, 4}}, {.strategy = strategy::zero2}};
  REQUIRE_THROWS_WITH(state.load_parameters(std::vector<float>(9)),
                      Catch::Contains("9 elements for regions covering 10"));
}

// The pooled bucket buffers of zero2/zero3 on a host backend: the caller waits for a reused
// buffer's last use before writing into it, so the pool hands out one whose last use is done,
// even a larger one, rather than the smallest that fits while its reduction is in flight, and
// tells the owner when none is idle (training_state then allocates, up to reductions_in_flight).
TEST_CASE("the bucket buffer pool prefers a buffer whose last use is done", "[training_state][gloo]") {
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(1, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 1);
    auto& engine = pg.backend();
    cohort::detail::buffer_pool<cohort::gloo> pool(engine);
    std::mutex mutex;
    std::condition_variable released;
    bool go = false;
    // A reduction still in flight: a task on the group's worker that waits until released.
    const auto in_flight = engine.enqueue([&] {
      std::unique_lock lock(mutex);
      released.wait(lock, [&] { return go; });
    });
    auto busy = pool.take(64);
    auto idle = pool.take(256);
    busy.last_use = in_flight;
    const void* busy_data = busy.data;
    const void* idle_data = idle.data;
    pool.put(std::move(busy));
    pool.put(std::move(idle));
    RANK_CHECK(pool.fit(32) == std::optional<std::size_t>(64));         // the smallest that fits
    RANK_CHECK(pool.fit(32, true) == std::optional<std::size_t>(256));  // the idle one
    auto taken = pool.take(32, true);
    RANK_CHECK(taken.data == idle_data);
    RANK_CHECK(pool.allocations() == 2);  // no new allocation for it
    // Only the busy one is left: the owner sees it, and may take a new one instead of waiting.
    RANK_CHECK(!pool.idle_fits(32));
    auto fresh = pool.take_new(32);
    RANK_CHECK(fresh.data != busy_data && pool.allocations() == 3);
    RANK_CHECK(!in_flight.test());  // nothing waited for the reduction in flight
    {
      std::lock_guard lock(mutex);
      go = true;
    }
    released.notify_all();
    in_flight.wait();
    RANK_CHECK(pool.idle_fits(32));
    auto next = pool.take(32, true);  // the first buffer's last use is done now
    RANK_CHECK(next.data == busy_data);
    pool.put(std::move(taken));
    pool.put(std::move(next));
    pool.put(std::move(fresh));
  });
}
