// training_state over the trainer's own buffers, and what the shared suites of
// test_training_state.cpp (which run every strategy over owned and adopted buffers, with the
// state's optimizer and with the trainer's) do not pin: the adopted buffer's length and what
// it covers, the bytes a step copies (none), the trainer's optimizer's contract, what an
// unmarked region contributes, a view that outlives its state, and a join whose loop throws.
// Gloo ranks as threads; SGD at lr 1 from zero makes the parameters minus the averaged
// gradients, so what was reduced reads back exactly.
#include <catch2/catch.hpp>

#include <cohort/parallel/training_state.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "flat_fixtures.hpp"
#include "rank_failures.hpp"
#include "support.hpp"

namespace {

using cohort::region;
using cohort::strategy;
using state_type = cohort::training_state<cohort::gloo>;

// `count` regions of `per_region` floats, region r alone in layer r.
std::vector<region> one_per_layer(std::size_t count, std::size_t per_region) {
  std::vector<region> regions;
  for (std::size_t r = 0; r < count; ++r) regions.push_back({"t" + std::to_string(r), r * per_region, per_region, r});
  return regions;
}

// The state's SGD, chosen explicitly: over adopted buffers the default is the trainer's.
cohort::training_options sgd_at_lr_one(strategy kind, std::size_t bucket_bytes) {
  return {
      .strategy = kind, .bucket_bytes = bucket_bytes, .sgd = cohort::sgd_options{.lr = 1}, .trainer_optimizer = false};
}

// Each of 3 ranks adopts the buffers `buffers(rank)` gives (parameters, gradients; kept alive
// by the caller) over 4 layers of 25 floats at zero2; what each rank's construction threw.
std::vector<std::string> adoption_errors(
    const std::function<std::pair<std::span<float>, std::span<float>>(int rank)>& buffers) {
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::string> errors(3);
  cohort_test::run_ranks(3, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 3);
    const auto [parameters, gradients] = buffers(rank);
    try {
      state_type state(pg, parameters, gradients, one_per_layer(4, 25), {.strategy = strategy::zero2});
    } catch (const cohort::error& e) {
      errors[static_cast<std::size_t>(rank)] = e.what();
    }
  });
  return errors;
}

}  // namespace

TEST_CASE("the adopted buffer's length refuses elements no region covers on every rank, naming them",
          "[training_state][adopted][gloo][faults]") {
  const auto regions = one_per_layer(4, 25);  // 100 elements
  // Rank 2's buffers hold a tensor more, which its regions forgot.
  std::vector<std::vector<float>> buffers{std::vector<float>(100), std::vector<float>(100), std::vector<float>(110)};
  auto errors = adoption_errors([&](int rank) {
    auto& mine = buffers[static_cast<std::size_t>(rank)];
    return std::pair{std::span(mine), std::span(mine)};
  });
  CHECK_THAT(errors[2], Catch::Contains("elements 100..110 of the 110-element flat buffer belong to no region") &&
                            Catch::Contains("a tensor at the buffer's end left out of the regions?"));
  CHECK_THAT(errors[0], Catch::Contains("rank 2 refused its regions or options (its error says why)"));
  CHECK_THAT(errors[1], Catch::Contains("rank 2 refused its regions or options"));

  // Parameters and gradients of other lengths; a buffer shorter than the regions; no
  // parameters where the state updates them in place.
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(1, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 1);
    std::vector<float> params(90), grads(100), shorter(80);
    RANK_CHECK_THROWS(cohort::error, state_type(pg, std::span(params), std::span(grads), regions),
                      "the adopted parameter buffer has 90 elements, the gradient buffer 100");
    RANK_CHECK_THROWS(cohort::error, state_type(pg, std::span(shorter), std::span(shorter), regions),
                      "region 3 't3' (elements 75..100) ends past the buffer's 80 elements");
    RANK_CHECK_THROWS(cohort::error, state_type(pg, std::span<float>(), std::span(grads), regions),
                      "no adopted parameter buffer under ddp");
    // At zero3 the parameters may come later: the state shards them either way.
    state_type sharded(pg, std::span<float>(), std::span(grads), regions, {.strategy = strategy::zero3});
    sharded.load_parameters(std::vector<float>(100, 0.5f));
    RANK_CHECK(sharded.gather_parameters() == std::vector<float>(100, 0.5f));
    // The state's own buffers: the length comes with load_parameters, which names the tail.
    state_type owned(pg, regions);
    RANK_CHECK_THROWS(cohort::error, owned.load_parameters(std::vector<float>(110)),
                      "110 elements for regions covering 100: elements 100..110 belong to no region");
  });
}

TEST_CASE("a step copies no parameter or gradient bytes but zero3's over owned shards: remainders, at 1 rank all",
          "[training_state][adopted][gloo]") {
  for (const bool adopted : {false, true})
    for (const strategy kind : {strategy::ddp, strategy::zero1, strategy::zero2, strategy::zero3})
      for (const int world : {1, 2, 3}) {
        // 4 layers of 64 floats: at 2 ranks every range divides; at 3 each leaves 1 element.
        const auto regions = one_per_layer(4, 64);
        auto store = std::make_shared<cohort::memory_store>();
        std::vector<std::size_t> copied(static_cast<std::size_t>(world)), wire(copied.size());
        cohort_test::run_ranks(world, [&](int rank) {
          auto pg = cohort_test::make_gloo_group(store, rank, world);
          std::vector<float> params(256, 0.0f), grads(256, 0.0f);
          std::optional<state_type> held;
          if (adopted)
            held.emplace(pg, std::span(params), std::span(grads), regions, sgd_at_lr_one(kind, 256));
          else
            held.emplace(pg, regions, sgd_at_lr_one(kind, 256));
          auto& state = *held;
          for (int step = 0; step < 2; ++step) {
            std::fill(grads.begin(), grads.end(), 0.0f);
            for (std::size_t l = 0; l < 4; ++l) (void)state.gather(l);
            for (std::size_t l = 4; l-- > 0;) {
              auto layer = state.gather(l);
              for (auto& g : state.gradient(l)) g = 1.0f;
              state.mark_ready(l);
            }
            state.step();
          }
          copied[static_cast<std::size_t>(rank)] = state.copied_bytes_per_step();
        });
        INFO(cohort::to_string(kind) << " at " << world << " ranks, " << (adopted ? "adopted" : "owned"));
        // zero3 over the state's shards at 3 ranks: each layer's one remaining float copied into
        // its gathered buffer, by the forward's gather and the backward's, but the top layer's
        // once (held from the forward's end into the backward); at 1 rank each such gather is a
        // copy of the whole layer. Over the trainer's buffer a layer is gathered in place, where
        // this rank's chunks and the remainders already are: nothing is copied.
        const std::size_t gathers = 2 * 4 - 1;
        std::size_t expected = 0;
        if (kind == strategy::zero3 && !adopted && world == 3) expected = gathers * sizeof(float);
        if (kind == strategy::zero3 && !adopted && world == 1) expected = gathers * 64 * sizeof(float);
        for (const std::size_t bytes : copied) CHECK(bytes == expected);
      }
}

TEST_CASE("at zero3 the forward's top layer is the backward's first, whether a rank keeps its view or ends it",
          "[training_state][zero3][gloo]") {
  // Rank 1 keeps its view of the top layer from the forward into the backward; ranks 0 and 2
  // end it, and the state holds the layer for them. Either way no rank gathers it again, so
  // the collectives pair up and every rank moves the same bytes.
  const int world = 3;
  const auto regions = one_per_layer(4, 64);
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::size_t> wire(world);
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    state_type state(pg, regions, sgd_at_lr_one(strategy::zero3, 256));
    state.load_parameters(std::vector<float>(256, 0.0f));
    for (int step = 0; step < 2; ++step) {
      std::optional<state_type::layer_view> kept;
      for (std::size_t l = 0; l < 4; ++l) {
        auto layer = state.gather(l);
        if (rank == 1 && l == 3) kept = std::move(layer);
      }
      for (std::size_t l = 4; l-- > 0;) {
        auto layer = state.gather(l);
        for (auto& g : state.gradient(l)) g = static_cast<float>(rank + 1);
        state.mark_ready(l);
        if (l == 3) kept.reset();
      }
      state.step();
    }
    const auto params = state.gather_parameters();
    for (std::size_t e = 0; e < params.size(); ++e)
      RANK_CHECK(params[e] == -4.0f, "element " << e << ": " << params[e]);  // two steps of the average, 2
    wire[static_cast<std::size_t>(rank)] = state.wire_bytes_per_step();
  });
  CHECK(wire[0] == wire[1]);
  CHECK(wire[1] == wire[2]);
}

TEST_CASE("the trainer's optimizer must publish each step before the state goes on, and only it publishes",
          "[training_state][adopted][gloo][faults]") {
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 2);
    const auto regions = one_per_layer(2, 8);
    std::vector<float> params(16, 1.0f), grads(16, 0.0f);
    state_type state(pg, std::span(params), std::span(grads), regions,
                     {.strategy = strategy::zero1, .trainer_optimizer = true});
    RANK_CHECK(state.checkpoint_tensors() == std::vector<std::string>({"parameters"}));
    RANK_CHECK_THROWS(cohort::error, state.publish_parameters(), "no step() to publish");
    for (auto& g : grads) g = static_cast<float>(rank + 1);
    state.mark_layer_ready(1);
    state.mark_layer_ready(0);
    const auto result = state.step();
    RANK_CHECK(!result.skipped);
    RANK_CHECK(result.gradient_scale == 1.0);
    // This rank's part of each region: its chunk of the averaged gradients, 1.5 everywhere.
    std::size_t owned = 0;
    for (const auto& span : state.owned_spans()) {
      RANK_CHECK(span.parameters.data() == params.data() + span.offset);
      for (const float g : span.gradients) RANK_CHECK(g == 1.5f);
      for (auto& p : span.parameters) p -= 1.0f;  // the trainer's update
      owned += span.parameters.size();
    }
    RANK_CHECK(owned == 8);
    RANK_CHECK_THROWS(cohort::error, state.gradient(0), "publish_parameters() was not called");
    RANK_CHECK_THROWS(cohort::error, (void)state.gather(0), "publish_parameters() was not called");
    state.publish_parameters();
    // Every rank's update is everyone's: the whole buffer moved by one.
    for (const float p : params) RANK_CHECK(p == 0.0f, p);
    RANK_CHECK_THROWS(cohort::error, state.publish_parameters(), "no step() to publish");
  });
  store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(1, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 1);
    state_type state(pg, one_per_layer(2, 8));
    RANK_CHECK_THROWS(cohort::error, state.publish_parameters(), "the state's own optimizer publishes its updates");
  });
}

TEST_CASE("a region written but not marked contributes what it holds, one never written contributes zeros",
          "[training_state][adopted][gloo]") {
  for (const bool adopted : {false, true})
    for (const strategy kind : {strategy::ddp, strategy::zero2}) {
      auto store = std::make_shared<cohort::memory_store>();
      cohort_test::run_ranks(2, [&](int rank) {
        auto pg = cohort_test::make_gloo_group(store, rank, 2);
        const auto regions = one_per_layer(3, 8);
        std::vector<float> params(24, 0.0f), grads(24, 0.0f);
        std::optional<state_type> held;
        if (adopted)
          held.emplace(pg, std::span(params), std::span(grads), regions, sgd_at_lr_one(kind, 32));
        else
          held.emplace(pg, regions, sgd_at_lr_one(kind, 32));
        auto& state = *held;
        // Rank 0 writes and marks everything (1, 2, 3). Rank 1 writes region 2 (10) and
        // marks it, writes region 1 (20) but never marks it, and leaves region 0 alone.
        for (std::size_t r = 3; r-- > 0;) {
          if (rank == 1 && r == 0) continue;
          for (auto& g : state.gradient(r)) g = rank == 0 ? static_cast<float>(r + 1) : (r == 2 ? 10.0f : 20.0f);
          if (rank == 0 || r == 2) state.mark_ready(r);
        }
        state.step();
        const auto after = state.gather_parameters();
        const float want[3] = {-0.5f, -11.0f, -6.5f};  // -(1 + 0) / 2, -(2 + 20) / 2, -(3 + 10) / 2
        for (std::size_t r = 0; r < 3; ++r)
          RANK_CHECK(after[r * 8] == want[r], cohort::to_string(kind) << (adopted ? " adopted" : " owned")
                                                                      << ", region " << r << ": " << after[r * 8]);
      });
    }
}

TEST_CASE("a layer view that outlives its state is named when the state ends, and cut off from it",
          "[training_state][gloo][faults]") {
  int pipe_fds[2];
  REQUIRE(::pipe(pipe_fds) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::dup2(pipe_fds[1], 2);
    ::close(pipe_fds[0]);
    // The abort is this child's whole verdict: Catch's handler (not async-signal-safe, which
    // TSan reports and then exits 66 instead of dying by the signal) is not the child's.
    std::signal(SIGABRT, SIG_DFL);
    auto store = std::make_shared<cohort::memory_store>();
    auto pg = cohort_test::make_gloo_group(store, 0, 1);
    std::optional<state_type> state;
    state.emplace(pg, one_per_layer(4, 8), cohort::training_options{.strategy = strategy::zero3});
    auto view = state->gather(2);
    auto other = state->gather(3);
    other.reset();
    state.reset();  // view still alive: named (and, without NDEBUG, the process aborts here)
    try {
      (void)view.param(2);
    } catch (const cohort::error& e) {
      std::fprintf(stderr, "param: %s\n", e.what());
      std::fflush(stderr);
      ::_exit(3);
    }
    ::_exit(4);
  }
  ::close(pipe_fds[1]);
  std::string text;
  char buffer[4096];
  for (ssize_t n; (n = ::read(pipe_fds[0], buffer, sizeof buffer)) > 0;)
    text.append(buffer, static_cast<std::size_t>(n));
  ::close(pipe_fds[0]);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK_THAT(text, Catch::Contains("training_state destroyed while 1 layer view(s) are alive (layer 2)"));
#if defined(NDEBUG)
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 3);
  CHECK_THAT(text, Catch::Contains("region 2 of layer 2: the view outlived its training_state"));
#else
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGABRT);
#endif
}

TEST_CASE("join(loop) passes the loop's error on and leaves the join, and evaluation() refuses a step's calls",
          "[training_state][gloo][faults]") {
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(1, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 1);
    state_type state(pg, one_per_layer(2, 8), sgd_at_lr_one(strategy::ddp, 32));
    RANK_CHECK_THROWS(std::runtime_error, state.join([] { throw std::runtime_error("the loader failed"); }),
                      "the loader failed");
    // Left: a second join runs, steps and ends.
    int steps = 0;
    state.join([&] {
      for (int t = 0; t < 2; ++t, ++steps) {
        state.mark_layer_ready(1);
        state.mark_layer_ready(0);
        state.step();
      }
    });
    RANK_CHECK(steps == 2);
    RANK_CHECK_THROWS(cohort::error, state.join([&] { state.join([] {}); }), "a join is already running");
    // The trainer's optimizer: a rank out of data still updates its part, so join needs it.
    std::vector<float> params(16), grads(16);
    state_type own(pg, std::span(params), std::span(grads), one_per_layer(2, 8), {.trainer_optimizer = true});
    RANK_CHECK_THROWS(cohort::error, own.join([] {}), "pass join_options::update");
    auto evaluating = state.evaluation();
    (void)state.gather(1);
    RANK_CHECK_THROWS(cohort::error, state.gradient(0), "gradient() inside evaluation()");
    RANK_CHECK_THROWS(cohort::error, state.mark_ready(0), "mark_ready() inside evaluation()");
    RANK_CHECK_THROWS(cohort::error, state.step(), "step() inside evaluation()");
  });
}

// llm.c's `if (rank == 0) sample()` at zero3, through cohort::run_ranks as a trainer runs its
// ranks: rank 0 gathers in evaluation() alone, while the others start the next step (their
// forward's gathers) or have finished. Every rank fails within seconds (the group's timeout
// is 60 s), and the errors name the evaluation, not only call numbers.
TEST_CASE("at zero3 an evaluation on one rank only fails every rank within seconds, naming it",
          "[training_state][adopted][gloo][faults]") {
  for (const bool others_finish : {false, true}) {
    INFO((others_finish ? "ranks 1, 2 finished" : "ranks 1, 2 start the next step"));
    const auto [errors, took] = cohort_test::run_ranks_keeping_errors(
        3, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
          cohort::gloo::options opts;
          opts.timeout = std::chrono::seconds(60);  // what ends the calls must not be the timeout
          cohort::process_group<cohort::gloo> pg{store, env, opts};
          std::vector<float> params(4 * 30, 0.5f), grads(params.size());
          state_type state(pg, std::span(params), std::span(grads), one_per_layer(4, 30),
                           sgd_at_lr_one(strategy::zero3, 64));
          const auto train_step = [&] {
            for (std::size_t l = 0; l < 4; ++l) (void)state.gather(l);
            for (std::size_t l = 4; l-- > 0;) {
              auto layer = state.gather(l);
              for (auto& g : state.gradient(l)) g = 0.01f;  // region l is layer l
              state.mark_ready(l);
            }
            state.step();
          };
          train_step();
          if (env.rank == 0) {
            auto scope = pg.call_context("sample");
            auto evaluating = state.evaluation();
            for (std::size_t l = 0; l < 4; ++l) (void)state.gather(l);
          } else if (!others_finish) {
            train_step();
          }
        });
    for (const auto& text : errors) UNSCOPED_INFO(text);
    CHECK(took < 15.0);
    CHECK_THAT(errors[0], Catch::Contains("[sample: evaluation() agreement]"));
    // The cause, and what to do, on every rank that failed (finished ranks have no error).
    for (const int rank : (others_finish ? std::vector<int>{0} : std::vector<int>{0, 1, 2})) {
      INFO("rank " << rank);
      CHECK_THAT(errors[static_cast<std::size_t>(rank)],
                 Catch::Contains("rank 0 entered evaluation() (sampling or evaluating) alone, without ranks 1, 2: at "
                                 "zero3 evaluation() and sampling gather parameters") &&
                     Catch::Contains("run evaluation() and its gathers on every rank"));
    }
    if (others_finish) {
      CHECK_THAT(errors[0], Catch::Contains("ranks 1, 2 left the group"));
    } else {
      for (const int rank : {1, 2}) {
        INFO("rank " << rank);
        CHECK_THAT(errors[static_cast<std::size_t>(rank)], Catch::Contains("[step 2 gather of layer 0]"));
        CHECK_THAT(errors[static_cast<std::size_t>(rank)], Catch::Contains("evaluation() agreement"));
      }
    }
  }
}

// A trainer that allocates its gradients in its first backward (as many C trainers do) has
// only a null pointer at construction: taken for "the state owns the gradients", it trained
// nothing, silently. Refused now, naming the buffer; such a trainer passes an empty span and
// binds its buffer once it has one.
TEST_CASE("a null adopted buffer is refused on every rank, naming it, and gradients allocated later are bound then",
          "[training_state][adopted][gloo][faults]") {
  const auto regions = one_per_layer(4, 25);  // 100 elements
  // Rank 1 passes its not-yet-allocated gradients.
  std::vector<std::vector<float>> buffers(3, std::vector<float>(100));
  const auto errors = adoption_errors([&](int rank) {
    auto& mine = buffers[static_cast<std::size_t>(rank)];
    return std::pair{std::span(mine),
                     rank == 1 ? std::span<float>(static_cast<float*>(nullptr), 100) : std::span(mine)};
  });
  CHECK_THAT(errors[1], Catch::Contains("the adopted gradient buffer is null (100 elements)") &&
                            Catch::Contains("bind_gradients"));
  CHECK_THAT(errors[0], Catch::Contains("rank 1 refused its regions or options"));
  CHECK_THAT(errors[2], Catch::Contains("rank 1 refused its regions or options"));

  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(1, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 1);
    std::vector<float> params(100), grads(100), shorter(90);
    RANK_CHECK_THROWS(cohort::error,
                      state_type(pg, std::span<float>(static_cast<float*>(nullptr), 100), std::span(grads), regions),
                      "the adopted parameter buffer is null (100 elements)");
    // No gradient buffer yet: every call that writes or reduces gradients says what to do.
    state_type lazy(pg, std::span(params), std::span<float>(), regions, sgd_at_lr_one(strategy::zero2, 200));
    RANK_CHECK_THROWS(cohort::error, lazy.gradient(0), "gradient() with no gradient buffer");
    RANK_CHECK_THROWS(cohort::error, lazy.mark_ready(0), "mark_ready() with no gradient buffer");
    RANK_CHECK_THROWS(cohort::error, lazy.step(), "call state.bind_gradients(the trainer's flat gradient buffer)");
    RANK_CHECK_THROWS(cohort::error, lazy.bind_gradients(std::span(shorter)),
                      "a gradient buffer of 90 elements for a flat buffer of 100");
    lazy.bind_gradients(std::span(grads));
    RANK_CHECK(lazy.gradient(3).data() == grads.data() + 75);
    RANK_CHECK_THROWS(cohort::error, lazy.bind_gradients(std::span(grads)), "a gradient buffer is bound already");
    state_type owned(pg, regions);
    RANK_CHECK_THROWS(cohort::error, owned.bind_gradients(std::span(grads)), "the state keeps its own gradients");
  });

  // Ranks 1 and 2 allocate their gradients in their first backward (rank 2 with its own
  // optimizer's spans asked for before), rank 0 passes them at construction: all train alike.
  for (const strategy kind : {strategy::ddp, strategy::zero2, strategy::zero3}) {
    store = std::make_shared<cohort::memory_store>();
    cohort_test::run_ranks(3, [&](int rank) {
      auto pg = cohort_test::make_gloo_group(store, rank, 3);
      std::vector<float> params(100, 0.0f), grads(rank == 0 ? 100 : 0);
      state_type state(pg, std::span(params), std::span(grads), regions, sgd_at_lr_one(kind, 100));
      for (int step = 0; step < 2; ++step) {
        for (std::size_t l = 0; l < 4; ++l) (void)state.gather(l);
        if (grads.empty()) {
          grads.assign(100, 0.0f);
          state.bind_gradients(std::span(grads));
        }
        std::fill(grads.begin(), grads.end(), 0.0f);
        for (std::size_t l = 4; l-- > 0;) {
          auto layer = state.gather(l);
          for (std::size_t j = 0; j < 25; ++j) grads[l * 25 + j] = static_cast<float>(rank + 1);  // its own pointers
          state.mark_ready(l);
        }
        const auto result = state.step();
        RANK_CHECK(result.grad_norm == Approx(20.0));  // the average, 2, over 100 elements
      }
      for (const float p : state.gather_parameters()) RANK_CHECK(p == -4.0f, cohort::to_string(kind) << ": " << p);
    });
  }
}

// DDP's contract: a trainer that hands over its buffers keeps its update. The adopting
// constructor used to run the state's AdamW (lr 1e-3) on them unless told otherwise.
TEST_CASE("over adopted buffers the trainer's optimizer is the default: step() reduces and updates nothing",
          "[training_state][adopted][gloo]") {
  for (const strategy kind : {strategy::ddp, strategy::zero2}) {
    auto store = std::make_shared<cohort::memory_store>();
    cohort_test::run_ranks(2, [&](int rank) {
      auto pg = cohort_test::make_gloo_group(store, rank, 2);
      const auto regions = one_per_layer(2, 8);
      std::vector<float> params(16, 1.0f), grads(16, static_cast<float>(rank + 1));
      state_type state(pg, std::span(params), std::span(grads), regions, {.strategy = kind});
      RANK_CHECK(state.options().trainer_optimizer == true);
      RANK_CHECK(state.checkpoint_tensors() == std::vector<std::string>({"parameters"}));
      state.mark_layer_ready(1);
      state.mark_layer_ready(0);
      const auto result = state.step();
      RANK_CHECK(!result.skipped);
      for (const float p : params) RANK_CHECK(p == 1.0f, cohort::to_string(kind) << ": " << p);
      for (const auto& span : state.owned_spans())
        for (const float g : span.gradients) RANK_CHECK(g == 1.5f);
      RANK_CHECK_THROWS(cohort::error, state.mark_ready(0), "publish_parameters() was not called");
      state.publish_parameters();

      // The state's own optimizer over the trainer's buffers, chosen: SGD at lr 1.
      std::vector<float> chosen_params(16, 1.0f), chosen_grads(16, static_cast<float>(rank + 1));
      state_type chosen(pg, std::span(chosen_params), std::span(chosen_grads), regions,
                        sgd_at_lr_one(kind, 8 * sizeof(float)));
      RANK_CHECK(chosen.options().trainer_optimizer == false);
      chosen.mark_layer_ready(1);
      chosen.mark_layer_ready(0);
      chosen.step();
      for (const float p : chosen.gather_parameters()) RANK_CHECK(p == -0.5f, p);
      // The state's own buffers keep the state's optimizer.
      state_type owned(pg, regions);
      RANK_CHECK(owned.options().trainer_optimizer == false);
    });
  }
}

// zero3 over the trainer's parameter buffer: a gather of layer l lands there, at l's offsets,
// so the trainer's own pointer arithmetic reads the current layer; outside a gather what this
// rank does not hold is NaN (it would be stale), and an update over the whole buffer (harmless
// under ddp..zero2, and how rank 1 and 2 update here) trains as owned_spans() do (rank 0).
TEST_CASE("zero3 over the trainer's buffer: gathers land at its offsets, the rest is NaN, a whole-buffer update trains",
          "[training_state][adopted][zero3][gloo]") {
  const int world = 3;
  const std::size_t per_layer = 31, n = 4 * per_layer;  // 31 = 3 x 10 + 1: a remainder in every range
  const auto regions = one_per_layer(4, per_layer);
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, world);
    std::vector<float> params(n), grads(n), expected(n);
    for (std::size_t i = 0; i < n; ++i) expected[i] = params[i] = 0.01f * static_cast<float>(i);
    state_type state(pg, std::span(params), std::span(grads), regions,
                     {.strategy = strategy::zero3, .bucket_bytes = per_layer * sizeof(float)});
    const float lr = 0.25f;
    for (int step = 0; step < 3; ++step) {
      for (std::size_t l = 0; l < 4; ++l) {
        auto layer = state.gather(l);
        const float* own = params.data() + l * per_layer;  // the trainer's pointer arithmetic
        RANK_CHECK(layer.param(l).data() == own);
        for (std::size_t j = 0; j < per_layer; ++j)
          RANK_CHECK(own[j] == expected[l * per_layer + j], "step " << step << ", element " << l * per_layer + j);
      }
      std::fill(grads.begin(), grads.end(), 0.0f);
      for (std::size_t l = 4; l-- > 0;) {
        auto layer = state.gather(l);
        for (std::size_t j = 0; j < per_layer; ++j) grads[l * per_layer + j] = 0.5f * static_cast<float>(rank + 1);
        state.mark_ready(l);
      }
      const auto result = state.step();
      if (rank == 0) {
        for (const auto& o : state.owned_spans())
          for (std::size_t j = 0; j < o.parameters.size(); ++j)
            o.parameters[j] -= lr * o.gradients[j] * static_cast<float>(result.gradient_scale);
      } else {
        for (std::size_t i = 0; i < n; ++i) params[i] -= lr * grads[i] * static_cast<float>(result.gradient_scale);
      }
      state.publish_parameters();
      for (float& e : expected) e -= lr * 1.0f;  // the average of 0.5, 1 and 1.5
      // Outside a gather: this rank's chunks and the remainders, current; the rest NaN.
      std::size_t poisoned = 0;
      for (std::size_t i = 0; i < n; ++i) {
        if (std::isnan(params[i])) {
          ++poisoned;
          continue;
        }
        RANK_CHECK(params[i] == expected[i], "step " << step << ", element " << i);
      }
      RANK_CHECK(poisoned == n - state.owned_elements());
      RANK_CHECK(poisoned == 4 * 2 * 10);
    }
    RANK_CHECK(state.gather_parameters() == expected);
    // What this training holds: the trainer's two buffers, named as the trainer's, and no
    // parameter memory of the state's own (no shard, no gathered buffer).
    const auto memory = state.memory();
    RANK_CHECK(memory.adopted_parameters == n * sizeof(float));
    RANK_CHECK(memory.adopted_gradients == n * sizeof(float));
    RANK_CHECK(memory.parameters == 0);
    RANK_CHECK(memory.total() == memory.allocated() + 2 * n * sizeof(float));
  });
}
