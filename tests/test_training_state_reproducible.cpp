// training_options::reproducible: the parameters after every step have the same bits at any
// world size, strategy and bucket size, given the same sequence of micro-batches. Each rank
// runs M / world micro-steps on its run of micro-batches, with clipping that bites, under
// ddp, zero1, zero2 and zero3, over the state's buffers and AdamW and over adopted buffers with
// the trainer's own optimizer, and hybrid 2x2; the result is compared by memcmp with one
// rank's. Then the refusals, on every rank: the rule at construction, a rank with another
// micro-batch size, a rank with one micro-step more (hybrid too: one copy's rank), join(); and a
// checkpoint saved at 4 ranks zero3 resumed at 2 ranks ddp.

// Other specializations than the default library's (double parameters, bfloat16 with fp32
// gradients): this unit compiles training_state's and the checkpoint's bodies itself.
#define COHORT_TEMPLATE_BODIES

#include <catch2/catch.hpp>

#include <cohort/parallel/checkpoint.hpp>
#include <cohort/parallel/training_state.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint_fixtures.hpp"
#include "flat_fixtures.hpp"
#include "support.hpp"

namespace {

using cohort::region;
using cohort::strategy;

// flat_fixtures' stacked model: region 1 + l is a_l, 5 + l is b_l.
using cohort_test::element_count;
using cohort_test::stacked_model;
constexpr std::size_t layers = cohort_test::stacked_layers;
std::vector<std::size_t> regions_of(std::size_t l) {
  return l == 0 ? std::vector<std::size_t>{0} : std::vector<std::size_t>{l, l + layers};
}

float initial_parameter(std::size_t e) { return 0.1f * static_cast<float>(e % 11) - 0.5f; }
// Micro-batch i's gradient of element e at step s, from the parameter: the same on any rank
// that holds micro-batch i, so any difference in the result is the reduction's.
float micro_gradient(std::size_t i, int step, std::size_t e, float parameter) {
  return std::sin(0.37f * static_cast<float>(e) + 1.3f * static_cast<float>(i) + 0.5f * static_cast<float>(step)) *
             (1.0f + 0.25f * static_cast<float>(i % 3)) +
         0.3f * parameter;
}

constexpr cohort::adam_options adam{.lr = 0.05, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.1};
constexpr double max_norm = 0.5;
constexpr int steps = 4;

struct run {
  int world = 1;
  std::size_t micro_batches = 8;
  strategy kind = strategy::ddp;
  bool adopted = false;
  int group = 0;  // > 0: hybrid, groups of this size, world / group replicas
  std::size_t bucket_bytes = 24;
  int first_step = 0, end_step = steps;  // the steps run, [first_step, end_step)
  std::string resume_from = {};          // a checkpoint loaded before first_step
  std::string save_to = {};              // a directory the state is saved into after end_step
  bool shared_memory = true;             // false: Gloo's TCP between the ranks
  std::vector<double>* norms = nullptr;  // rank 0's grad_norm of every step, if given
};

// One micro-step: a forward through every layer, then the backward, top first: each region's gradient written from
// the parameters the view shows (adopted: into the trainer's buffer, which the state zeroed
// after the last micro-step, or the trainer before the step).
template <class State>
void backward(State& state, const std::vector<region>& regions, std::size_t micro_batch, int step, float* grads) {
  for (std::size_t l = 0; l <= layers; ++l) auto layer = state.gather(l);  // the forward (zero3: its gathers)
  for (std::size_t l = layers + 1; l-- > 0;) {
    auto view = state.gather(l);
    for (const std::size_t r : regions_of(l)) {
      const auto p = view.param(r);
      const std::span<float> g =
          grads ? std::span<float>(grads + regions[r].offset, regions[r].count) : state.gradient(r);
      for (std::size_t j = 0; j < g.size(); ++j) g[j] += micro_gradient(micro_batch, step, regions[r].offset + j, p[j]);
      state.mark_ready(r);
    }
  }
}

// One step's micro-steps, on micro-batches [first, first + count): all but the last each inside
// its own no_sync() scope, as the contract asks.
template <class State>
void micro_steps(State& state, const std::vector<region>& regions, std::size_t first, std::size_t count, int step,
                 float* grads = nullptr) {
  for (std::size_t t = 0; t + 1 < count; ++t) {
    auto accumulating = state.no_sync();
    backward(state, regions, first + t, step, grads);
  }
  backward(state, regions, first + count - 1, step, grads);
}

// body(group, replicas, rank) on `world` Gloo ranks: with group_size > 0 hybrid, in groups of
// that size split from the world (replicas: the ranks at the same place in every group), else
// the world as one group (replicas null).
template <class Body>
void on_ranks(int world, int group_size, Body&& body, bool shared_memory = true) {
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    cohort::gloo::options options;
    options.timeout = std::chrono::seconds(5);
    options.shared_memory = shared_memory;
    cohort_test::gloo_group pg(store, cohort::launch_env::explicit_ranks(rank, world), options);
    if (group_size == 0) return body(pg, static_cast<cohort_test::gloo_group*>(nullptr), rank);
    auto shards = pg.split(rank / group_size, rank);
    auto replicas = pg.split(rank % group_size, rank);
    body(*shards, &*replicas, rank);
  });
}

// body(engine): the host engine of a one-rank Gloo group, for the reproducible mode's passes alone.
template <class Body>
void on_host_engine(Body&& body) {
  on_ranks(1, 0, [&](cohort_test::gloo_group& pg, cohort_test::gloo_group*, int) { body(pg.backend()); });
}

// The trainer's own optimizer (adopted buffers): momentum SGD, element-wise.
template <class State>
void trainer_update(State& state, std::vector<float>& momentum, double gradient_scale) {
  for (const auto& s : state.owned_spans())
    for (std::size_t j = 0; j < s.parameters.size(); ++j) {
      float& m = momentum[s.owned + j];
      m = 0.9f * m + static_cast<float>(s.gradients[j] * gradient_scale);
      s.parameters[j] -= 0.05f * m;
    }
}

// The parameters after `steps` steps of `config`, as rank 0 gathers them.
std::vector<float> train(const run& config) {
  const auto regions = stacked_model();
  const std::size_t n = element_count(regions);
  std::vector<float> result;
  on_ranks(
      config.world, config.group,
      [&](cohort_test::gloo_group& group, cohort_test::gloo_group* replicas, int rank) {
        const cohort::training_options options{.strategy = config.kind,
                                               .bucket_bytes = config.bucket_bytes,
                                               .adam = adam,
                                               .max_grad_norm = max_norm,
                                               .reproducible = cohort::reproducible_options{config.micro_batches, 16}};
        std::vector<float> params(n), grads(n, 0.0f);
        for (std::size_t e = 0; e < n; ++e) params[e] = initial_parameter(e);
        std::optional<cohort::training_state<cohort::gloo, float>> state;
        if (config.adopted)
          state.emplace(group, std::span<float>(params), std::span<float>(grads), regions, options, replicas);
        else
          state.emplace(group, regions, options, replicas);
        if (!config.adopted) state->load_parameters(params);
        if (!config.resume_from.empty()) cohort::load_checkpoint(*state, config.resume_from);
        RANK_CHECK(state->reproducible());
        RANK_CHECK(state->bucket_count() > layers, "buckets " << state->bucket_count());
        std::vector<float> momentum(state->owned_elements(), 0.0f);
        const std::size_t per_rank = config.micro_batches / static_cast<std::size_t>(config.world);
        // The position of this rank's run among the world's: hybrid, replica-major.
        const std::size_t position =
            replicas ? static_cast<std::size_t>(replicas->rank() * group.world_size() + group.rank())
                     : static_cast<std::size_t>(rank);
        for (int step = config.first_step; step < config.end_step; ++step) {
          if (config.adopted) std::fill(grads.begin(), grads.end(), 0.0f);
          micro_steps(*state, regions, position * per_rank, per_rank, step, config.adopted ? grads.data() : nullptr);
          const auto stepped = state->step();
          RANK_CHECK(!stepped.skipped);
          RANK_CHECK(stepped.clip_factor < 1.0, "the norm " << stepped.grad_norm << " is not clipped");
          if (config.norms && rank == 0) config.norms->push_back(stepped.grad_norm);
          if (config.adopted) {
            trainer_update(*state, momentum, stepped.gradient_scale);
            state->publish_parameters();
          }
        }
        if (per_rank > 2) RANK_CHECK(state->memory().reproducible > 0);
        if (!config.save_to.empty())
          cohort::save_checkpoint(*state, config.save_to, static_cast<std::uint64_t>(config.end_step));
        auto gathered = state->gather_parameters();
        if (rank == 0) result = std::move(gathered);
      },
      config.shared_memory);
  return result;
}

std::string describe(const run& c) {
  return std::to_string(c.world) + " ranks" + (c.group > 0 ? " (groups of " + std::to_string(c.group) + ")" : "") +
         ", M " + std::to_string(c.micro_batches) + ", " + std::string(cohort::to_string(c.kind)) +
         (c.adopted ? ", adopted" : ", owned") + ", buckets of " + std::to_string(c.bucket_bytes) + " bytes" +
         (c.shared_memory ? "" : ", over TCP");
}

void expect_same_bits(const std::vector<float>& expected, const run& config) {
  const auto got = train(config);
  INFO(describe(config));
  REQUIRE(got.size() == expected.size());
  std::size_t differing = 0;
  for (std::size_t e = 0; e < got.size(); ++e)
    if (std::memcmp(&got[e], &expected[e], sizeof(float)) != 0) ++differing;
  CHECK(differing == 0);
}

void every_world_and_strategy(bool adopted) {
  for (const std::size_t micro_batches : {std::size_t{8}, std::size_t{6}}) {
    const auto expected = train({.world = 1, .micro_batches = micro_batches, .adopted = adopted});
    const std::vector<int> worlds = micro_batches == 8 ? std::vector<int>{1, 2, 4} : std::vector<int>{1, 3, 6};
    for (const int world : worlds)
      for (const strategy kind : {strategy::ddp, strategy::zero1, strategy::zero2, strategy::zero3})
        expect_same_bits(expected, {.world = world,
                                    .micro_batches = micro_batches,
                                    .kind = kind,
                                    .adopted = adopted,
                                    .bucket_bytes = world == 2 ? std::size_t{40} : std::size_t{24}});
  }
}

}  // namespace

TEST_CASE(
    "reproducible: the state's buffers and AdamW give the bits of one rank at 1, 2, 4 ranks (M 8) and 1, 3, 6 (M "
    "6), under ddp, zero1, zero2 and zero3, clipped",
    "[training_state][reproducible][gloo]") {
  every_world_and_strategy(false);
}

TEST_CASE(
    "reproducible: adopted buffers and the trainer's optimizer give the bits of one rank at every world and strategy",
    "[training_state][reproducible][gloo]") {
  every_world_and_strategy(true);
}

// Two ranks sum their pair of partials in the transport's reduce-scatter (training_state's
// reduce_canonically): with one micro-batch a rank (M 2, the transport's average) and with a
// run of two (M 4, its sum, then the divide by M), in shared memory and over TCP, every
// strategy, with buckets that leave remainders (the all-gathered path beside it).
TEST_CASE("reproducible: two ranks (M 2 and M 4) give the bits of one rank in shared memory and over TCP",
          "[training_state][reproducible][gloo]") {
  for (const std::size_t micro_batches : {std::size_t{2}, std::size_t{4}}) {
    const auto expected = train({.world = 1, .micro_batches = micro_batches});
    for (const bool shared_memory : {true, false})
      for (const strategy kind : {strategy::ddp, strategy::zero1, strategy::zero2, strategy::zero3})
        for (const std::size_t bucket_bytes : {std::size_t{24}, std::size_t{40}})
          expect_same_bits(expected, {.world = 2,
                                      .micro_batches = micro_batches,
                                      .kind = kind,
                                      .bucket_bytes = bucket_bytes,
                                      .shared_memory = shared_memory});
  }
}

TEST_CASE("reproducible: hybrid 2x2 (groups of 2, 2 replicas) gives the bits of one rank under every strategy",
          "[training_state][reproducible][gloo]") {
  const auto expected = train({.world = 1, .micro_batches = 8});
  for (const strategy kind : {strategy::ddp, strategy::zero1, strategy::zero2, strategy::zero3})
    expect_same_bits(expected, {.world = 4, .micro_batches = 8, .kind = kind, .group = 2});
}

namespace {

cohort::training_options reproducible_options(std::size_t micro_batches, std::size_t micro_batch_size) {
  return {.bucket_bytes = 24, .reproducible = cohort::reproducible_options{micro_batches, micro_batch_size}};
}

}  // namespace

TEST_CASE("reproducible: M and a world the rule cannot hold are refused at construction on every rank, naming the rule",
          "[training_state][reproducible][gloo]") {
  const auto regions = stacked_model();
  for (const auto& setting : {std::pair{4, std::size_t{6}}, std::pair{4, std::size_t{12}}}) {
    const int world = setting.first;  // named, not bound: clang 14 captures no structured binding
    const std::size_t micro_batches = setting.second;
    on_ranks(world, 0, [&](cohort_test::gloo_group& pg, cohort_test::gloo_group*, int) {
      const std::string text = RANK_CHECK_THROWS(
          cohort::error,
          (cohort::training_state<cohort::gloo, float>{pg, regions, reproducible_options(micro_batches, 8)}),
          "each rank needs a run of 2^j of them (M divisible by the world, M / world a power of two), or one rank");
      RANK_CHECK(text.find(std::to_string(micro_batches) + " micro-batches over 4 ranks") != std::string::npos, text);
    });
  }
  // One rank sums any M itself.
  on_ranks(1, 0, [&](cohort_test::gloo_group& pg, cohort_test::gloo_group*, int) {
    cohort::training_state<cohort::gloo, float> state{pg, regions, reproducible_options(6, 8)};
    RANK_CHECK(state.reproducible());
  });
}

TEST_CASE("reproducible: one rank's other micro-batch size is refused on every rank, naming it",
          "[training_state][reproducible][gloo]") {
  const auto regions = stacked_model();
  on_ranks(3, 0, [&](cohort_test::gloo_group& pg, cohort_test::gloo_group*, int rank) {
    RANK_CHECK_THROWS(
        cohort::error,
        (cohort::training_state<cohort::gloo, float>{pg, regions, reproducible_options(6, rank == 1 ? 16 : 8)}),
        "reproducible: rank 1 has 6 micro-batches of 16 samples, rank 0 6 of 8");
  });
}

TEST_CASE("reproducible: a rank that runs one micro-step more than M / world is refused at the step on every rank",
          "[training_state][reproducible][gloo]") {
  const auto regions = stacked_model();
  on_ranks(2, 0, [&](cohort_test::gloo_group& pg, cohort_test::gloo_group*, int rank) {
    cohort::training_state<cohort::gloo, float> state{pg, regions, reproducible_options(4, 8)};
    const std::size_t count = rank == 1 ? 3 : 2;  // M / world is 2
    RANK_CHECK_THROWS(cohort::error,
                      (micro_steps(state, regions, static_cast<std::size_t>(rank) * 2, count, 0), state.step()),
                      "rank 1 ran 3 micro-steps this step where every rank must run 2");
  });
}

TEST_CASE("reproducible: hybrid, one copy's rank that runs one micro-step more is refused at the step on every rank",
          "[training_state][reproducible][gloo]") {
  // Groups {0, 1} and {2, 3}, replicas {0, 2} and {1, 3}: rank 2, the second copy's first, is
  // position 2 of the tree. The first copy agrees within its group; it must learn of rank 2
  // from the exchange over the copies, not wait there for the second copy until the timeout.
  const auto regions = stacked_model();
  on_ranks(4, 2, [&](cohort_test::gloo_group& group, cohort_test::gloo_group* replicas, int rank) {
    cohort::training_state<cohort::gloo, float> state{group, regions, reproducible_options(8, 8), replicas};
    const std::size_t count = rank == 2 ? 3 : 2;  // M / world is 2
    RANK_CHECK_THROWS(cohort::error,
                      (micro_steps(state, regions, static_cast<std::size_t>(rank) * 2, count, 0), state.step()),
                      "rank 2 ran 3 micro-steps this step where every rank must run 2 (8 micro-batches over 4 ranks");
  });
}

TEST_CASE("reproducible: join() is refused on every rank", "[training_state][reproducible][gloo]") {
  const auto regions = stacked_model();
  on_ranks(2, 0, [&](cohort_test::gloo_group& pg, cohort_test::gloo_group*, int) {
    cohort::training_state<cohort::gloo, float> state{pg, regions, reproducible_options(4, 8)};
    bool ran = false;
    RANK_CHECK_THROWS(cohort::error, state.join([&] { ran = true; }), "reproducible: a join changes which ranks");
    RANK_CHECK(!ran);
  });
}

TEST_CASE("reproducible: saved at 4 ranks zero3 and resumed at 2 ranks ddp, the bits of the run that never stopped",
          "[training_state][reproducible][checkpoint][gloo]") {
  const auto expected = train({.world = 1, .micro_batches = 8, .end_step = 6});
  const auto dir = cohort_test::checkpoint_scratch("reproducible");
  train({.world = 4, .micro_batches = 8, .kind = strategy::zero3, .end_step = 3, .save_to = dir.string()});
  expect_same_bits(expected, {.world = 2,
                              .micro_batches = 8,
                              .kind = strategy::ddp,
                              .first_step = 3,
                              .end_step = 6,
                              .resume_from = (dir / "step-3").string()});
  std::filesystem::remove_all(dir);
}

namespace {

// The bins of x[0, count) added piece by piece at `cuts` (ascending, the last `count`), in
// the order `order` lists the pieces.
template <class Engine>
std::vector<std::int64_t> exact_bins(Engine& engine, const void* x, std::size_t element_bytes, cohort::dtype type,
                                     const std::vector<std::size_t>& cuts, const std::vector<std::size_t>& order) {
  std::vector<std::int64_t> words(cohort::detail::exact_squares_words(type), 0);
  for (const std::size_t piece : order) {
    const std::size_t from = piece == 0 ? 0 : cuts[piece - 1];
    cohort::add_exact_squares(engine, static_cast<const char*>(x) + from * element_bytes, cuts[piece] - from, type,
                              words.data())
        .wait();
  }
  return words;
}

// The norm without the bins: every square in long double (exact for float and the 16-bit
// types, whose squares have at most 48 bits), summed smallest first; within 2^-60 or so.
template <class T>
long double reference_norm(const std::vector<T>& x) {
  std::vector<long double> squares;
  for (const T value : x) {
    const auto wide = static_cast<long double>(cohort::detail::widened(value));
    squares.push_back(wide * wide);
  }
  std::sort(squares.begin(), squares.end());
  long double sum = 0;
  for (const long double square : squares) sum += square;
  return std::sqrt(sum);
}

// The T of `bits` (for the 16-bit types: their storage).
template <class T>
T from_bits(std::uint64_t bits) {
  if constexpr (std::is_same_v<T, float>) {
    return std::bit_cast<float>(static_cast<std::uint32_t>(bits));
  } else if constexpr (std::is_same_v<T, double>) {
    return std::bit_cast<double>(bits);
  } else {
    T value;
    value.bits = static_cast<std::uint16_t>(bits);
    return value;
  }
}

// Random values of every finite exponent (subnormal_only: exponent field 0, every fraction),
// with -0, 0, the largest finite value and the smallest subnormal among them.
template <class T>
std::vector<T> every_range(std::size_t count, bool subnormal_only) {
  constexpr auto layout = cohort::detail::exact_squares_layout_v<T>;
  std::uint64_t state = subnormal_only ? 7 : 3;
  const auto next = [&] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return state >> 11;
  };
  const std::uint64_t finite_exponents = (std::uint64_t{1} << layout.exponent_bits) - 1;  // all ones: inf, NaN
  const std::uint64_t fraction_mask = (std::uint64_t{1} << layout.fraction_bits) - 1;
  const int sign_place = layout.exponent_bits + layout.fraction_bits;
  std::vector<T> x(count);
  for (std::size_t e = 0; e < count; ++e) {
    const std::uint64_t exponent = subnormal_only || e % 5 == 0 ? 0 : next() % finite_exponents;
    x[e] = from_bits<T>(((next() & 1) << sign_place) | (exponent << layout.fraction_bits) | (next() & fraction_mask));
  }
  x[1] = from_bits<T>(std::uint64_t{1} << sign_place);  // -0
  x[2] = from_bits<T>(0);
  x[3] = from_bits<T>(1);  // the smallest subnormal
  if (!subnormal_only) x[4] = from_bits<T>(((finite_exponents - 1) << layout.fraction_bits) | fraction_mask);
  return x;
}

}  // namespace

// The binned squares (add_exact_squares, then exact_norm) against squares summed apart from
// them: over values of one scale (the sum without rounding trouble: within 2 ulps of the
// long double reference), every element of T's range (subnormals, the largest, -0), all
// subnormals (where a subnormal's scale shows), and counts across the host's runs of 2^16.
// The bins are the same words whatever cut and order the pieces were added in, an inf or a
// NaN is counted (the norm NaN), and a lone x gives |x| back, from the smallest subnormal up.
TEMPLATE_TEST_CASE("reproducible: the exact norm's bins sum every square exactly, whatever cut and order add them",
                   "[training_state][reproducible][gloo]", float, double, cohort::bfloat16, cohort::half) {
  using T = TestType;
  constexpr auto type = cohort::dtype_v<T>;
  const auto norm_of = [](const std::vector<std::int64_t>& words) { return cohort::detail::exact_norm(words, type); };
  on_host_engine([&](auto& engine) {
    for (const std::size_t count : {std::size_t{1}, std::size_t{9}, std::size_t{10007}, std::size_t{(1 << 17) + 37}}) {
      std::vector<T> scaled(count);  // one scale: the reference sums these without losing bits that matter
      for (std::size_t e = 0; e < count; ++e)
        scaled[e] = T(std::sin(0.61f * static_cast<float>(e)) * std::ldexp(1.0f, static_cast<int>(e % 9) - 4));
      const auto whole = exact_bins(engine, scaled.data(), sizeof(T), type, {count}, {0});
      const auto exact = norm_of(whole);
      const long double reference = reference_norm(scaled);
      RANK_CHECK(exact.nonfinite == 0);
      RANK_CHECK(std::abs(static_cast<long double>(exact.norm) - reference) <= 4.5e-16L * reference,
                 "count " << count << ": " << exact.norm << " vs " << static_cast<double>(reference));
      if (count < 9) continue;
      // Any cut, any order of the pieces: the same integer (the words may differ: a running
      // sum's pieces fall where its run cut it), the same norm.
      const auto total = cohort::detail::exact_squares_total(whole, type);
      const std::vector<std::size_t> cuts = {1, count / 3, count / 3 + 1, count - 2, count};
      for (const auto& order : {std::vector<std::size_t>{4, 0, 3, 1, 2}, std::vector<std::size_t>{0, 1, 2, 3, 4}}) {
        const auto words = exact_bins(engine, scaled.data(), sizeof(T), type, cuts, order);
        RANK_CHECK(cohort::detail::exact_squares_total(words, type) == total, "count " << count);
        const double norm = norm_of(words).norm;
        RANK_CHECK(std::memcmp(&norm, &exact.norm, sizeof norm) == 0, "count " << count);
      }
      // An inf or a NaN: counted, the norm NaN.
      for (const T bad : {T(std::numeric_limits<float>::infinity()), T(-std::numeric_limits<float>::infinity()),
                          T(std::numeric_limits<float>::quiet_NaN())}) {
        std::vector<T> with_bad = scaled;
        with_bad[count / 2] = bad;
        with_bad[count - 1] = bad;
        const auto found = norm_of(exact_bins(engine, with_bad.data(), sizeof(T), type, {count}, {0}));
        RANK_CHECK(found.nonfinite == 2 && std::isnan(found.norm), "count " << count << ": " << found.nonfinite);
      }
    }
    // T's whole range, and subnormals alone (a double's squares are not exact in long double).
    if constexpr (!std::is_same_v<T, double>)
      for (const bool subnormal_only : {false, true}) {
        const auto x = every_range<T>(10007, subnormal_only);
        const auto exact = norm_of(exact_bins(engine, x.data(), sizeof(T), type, {x.size()}, {0}));
        const long double reference = reference_norm(x);
        RANK_CHECK(std::abs(static_cast<long double>(exact.norm) - reference) <= 4.5e-16L * reference,
                   (subnormal_only ? "subnormals: " : "every range: ")
                       << exact.norm << " vs " << static_cast<double>(reference));
      }
    // A lone x: sqrt(x^2 rounded) is |x| (the squares of a double too: they neither overflow nor
    // underflow in the bins), and -0 adds nothing.
    const auto lone = every_range<T>(64, false);
    for (const T x : lone) {
      const auto exact = norm_of(exact_bins(engine, &x, sizeof(T), type, {1}, {0}));
      const double expected = std::abs(cohort::detail::widened(x));
      RANK_CHECK(std::memcmp(&exact.norm, &expected, sizeof expected) == 0, exact.norm << " vs " << expected);
    }
    const std::vector<T> zeros = {from_bits<T>(0), lone[1]};
    const auto zero_words = exact_bins(engine, zeros.data(), sizeof(T), type, {2}, {0});
    RANK_CHECK(std::all_of(zero_words.begin(), zero_words.end(), [](std::int64_t w) { return w == 0; }));
  });
}

// Ranks that hold pieces of other sizes (1 element, most of them, the rest in two calls) and
// sum their bins by one all-reduce: the integer and the norm's bits of one rank's over all.
TEST_CASE("reproducible: words that are not a floating type's whole bins are refused, not read as a norm of 0",
          "[training_state][reproducible]") {
  const std::vector<std::int64_t> short_words(cohort::detail::exact_squares_words(cohort::dtype::float32) - 1);
  CHECK_THROWS_WITH(cohort::detail::exact_norm(short_words, cohort::dtype::float32),
                    Catch::Contains("767 words given, 768 needed"));
  CHECK_THROWS_WITH(cohort::detail::exact_squares_total(short_words, cohort::dtype::int32),
                    Catch::Contains("not a floating type"));
}

TEST_CASE("reproducible: ranks holding uneven pieces sum their exact bins to one rank's norm, bit for bit",
          "[training_state][reproducible][gloo]") {
  const auto x = every_range<float>(10007, false);
  constexpr auto type = cohort::dtype::float32;
  std::vector<std::int64_t> expected_words;
  on_host_engine(
      [&](auto& engine) { expected_words = exact_bins(engine, x.data(), sizeof(float), type, {x.size()}, {0}); });
  const auto expected = cohort::detail::exact_norm(expected_words, type);
  REQUIRE(expected.norm > 0);
  on_ranks(3, 0, [&](cohort_test::gloo_group& pg, cohort_test::gloo_group*, int rank) {
    const std::vector<std::size_t> cuts = {1, 6000, 6001, x.size()};
    const std::vector<std::vector<std::size_t>> pieces = {{0}, {1}, {3, 2}};
    auto words = exact_bins(pg.backend(), x.data(), sizeof(float), type, cuts, pieces[static_cast<std::size_t>(rank)]);
    pg.all_reduce(std::span<std::int64_t>(words), cohort::op::sum).wait();
    RANK_CHECK(cohort::detail::exact_squares_total(words, type) ==
               cohort::detail::exact_squares_total(expected_words, type));
    const auto got = cohort::detail::exact_norm(words, type);
    RANK_CHECK(std::memcmp(&got.norm, &expected.norm, sizeof got.norm) == 0, got.norm << " vs " << expected.norm);
  });
}

// The training state's global norm, every step, at 3 ranks whose zero2 shards are cut unevenly
// (buckets that leave remainders) and at 6 under zero3: the bits of one rank's.
TEST_CASE("reproducible: the step's grad_norm has the bits of one rank's at 3 and 6 ranks, shards cut unevenly",
          "[training_state][reproducible][gloo]") {
  std::vector<double> expected, got;
  train({.world = 1, .micro_batches = 6, .norms = &expected});
  REQUIRE(expected.size() == static_cast<std::size_t>(steps));
  for (const auto& [world, kind] : {std::pair{3, strategy::zero2}, std::pair{6, strategy::zero3}}) {
    got.clear();
    train({.world = world, .micro_batches = 6, .kind = kind, .bucket_bytes = 40, .norms = &got});
    INFO(world << " ranks");
    REQUIRE(got.size() == expected.size());
    CHECK(std::memcmp(got.data(), expected.data(), got.size() * sizeof(double)) == 0);
  }
}

// The fused sum of parts that the reproducible reduction runs (one pass) against the passes it
// replaced: the tree's accumulates in for_each_canonical_pair's order, then the divide. Counts
// on and off the host's 2048-element blocks, values of mixed magnitudes so that the order of
// additions shows in the bits; out apart from the parts, and out on part 0 itself.
TEMPLATE_TEST_CASE(
    "reproducible: the fused canonical sum of parts has the bits of accumulate in the tree's order, "
    "then divide",
    "[training_state][reproducible][gloo]", float, double, cohort::bfloat16, cohort::half) {
  using T = TestType;
  constexpr auto type = cohort::dtype_v<T>;
  on_host_engine([&](auto& engine) {
    for (const std::size_t count : {std::size_t{1}, std::size_t{2047}, std::size_t{2049}, std::size_t{5003}})
      for (std::size_t n = 1; n <= 9; ++n)
        for (const int divisor : {0, 3, 8}) {
          std::vector<T> parts(n * count);
          for (std::size_t e = 0; e < parts.size(); ++e)
            parts[e] = T(std::sin(0.61f * static_cast<float>(e)) * std::ldexp(1.0f, static_cast<int>(e % 23) - 11));
          std::vector<T> expected = parts;
          cohort::for_each_canonical_pair(n, [&](std::size_t into, std::size_t from) {
            cohort::accumulate(engine, expected.data() + from * count, type, expected.data() + into * count, type,
                               count, true);
          });
          if (divisor != 0) cohort::divide(engine, expected.data(), count, type, divisor);
          std::vector<T> apart(count);
          cohort::canonical_sum_parts(engine, parts.data(), n, count, type, divisor, apart.data());
          std::vector<T> in_place = parts;
          cohort::canonical_sum_parts(engine, in_place.data(), n, count, type, divisor, in_place.data()).wait();
          RANK_CHECK(std::memcmp(apart.data(), expected.data(), count * sizeof(T)) == 0,
                     "apart: count " << count << ", " << n << " parts, divisor " << divisor);
          RANK_CHECK(std::memcmp(in_place.data(), expected.data(), count * sizeof(T)) == 0,
                     "in place: count " << count << ", " << n << " parts, divisor " << divisor);
        }
  });
}
