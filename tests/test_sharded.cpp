// Sharded parameters (ZeRO-3 / FSDP) on Gloo ranks as threads: gathers return the original
// weights for awkward sizes, releases are real (peak memory and pool reuse), reduce-scatter
// leaves each rank its slice of the averaged gradient, and training the examples' MLP with
// sharded parameters (plain, with replicated units, hybrid, and across a 4 -> 2 rank
// sharded checkpoint) equals single-rank training computed directly.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "../examples/mlp.hpp"
#include "support.hpp"

#if COHORT_HAS_GLOO
#include "cohort/backend/gloo.hpp"
#include "cohort/optim.hpp"
#include "cohort/sharded.hpp"
#include "cohort/store.hpp"
#if __has_include("cohort/reducer.hpp")
#include "cohort/reducer.hpp"
#endif
#endif

#if COHORT_HAS_GLOO

using namespace std::chrono_literals;
using group = cohort::process_group<cohort::gloo>;
using sharded = cohort::sharded_parameters<cohort::gloo, float>;
namespace fs = std::filesystem;

namespace {

group make_group(const std::shared_ptr<cohort::memory_store>& store, int rank, int world) {
  cohort::gloo::options opts;
  opts.timeout = 20s;
  return group(store, cohort::launch_env::explicit_ranks(rank, world), opts);
}

// A distinct, exactly representable value per (unit, parameter, element).
float original_value(std::size_t unit, std::size_t parameter, std::size_t index) {
  return static_cast<float>(unit * 1000 + parameter * 100) + static_cast<float>(index) * 0.25f;
}

std::vector<std::vector<float>> make_parameters(const std::vector<std::vector<std::size_t>>& units) {
  std::vector<std::vector<float>> all;
  for (std::size_t u = 0; u < units.size(); ++u)
    for (std::size_t p = 0; p < units[u].size(); ++p) {
      all.emplace_back(units[u][p]);
      for (std::size_t i = 0; i < units[u][p]; ++i) all.back()[i] = original_value(u, p, i);
    }
  return all;
}

// Sizes not divisible by 2, 3 or 4, and units smaller than the world.
const std::vector<std::vector<std::size_t>> awkward_units{{5, 3}, {1}, {2}, {7, 11, 13}, {100}, {0, 3}};

std::string temporary_directory(const std::string& name) {
  const auto path = fs::temp_directory_path() / ("cohort_sharded_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(path);
  return path.string();
}

}  // namespace

TEST_CASE("gather returns exactly the original parameters, whatever the sizes and world", "[sharded][gloo]") {
  const auto full = make_parameters(awkward_units);
  for (int world : {1, 2, 3, 4}) {
    auto store = std::make_shared<cohort::memory_store>();
    cohort_test::run_ranks(world, [&](int rank) {
      auto pg = make_group(store, rank, world);
      for (int init = 0; init < 3; ++init) {
        sharded params(pg, awkward_units, {.prefetch = 2});
        if (init == 0) {
          params.init_from_full(full);
        } else if (init == 1) {
          params.scatter_from(world - 1, rank == world - 1 ? full : std::vector<std::vector<float>>{});
        } else {
          params.init_with([&](std::size_t u, std::size_t p, std::size_t first, std::span<float> values) {
            for (std::size_t i = 0; i < values.size(); ++i) values[i] = original_value(u, p, first + i);
          });
        }
        // Shards hold their slice of the flattened unit, zero past its end.
        for (std::size_t u = 0; u < params.unit_count(); ++u) {
          auto shard = params.shard(u);
          for (std::size_t i = 0; i < shard.size(); ++i) {
            const std::size_t flat = params.shard_offset(u) + i;
            float want = 0;
            std::size_t offset = 0;
            for (std::size_t p = 0; p < awkward_units[u].size(); offset += awkward_units[u][p], ++p)
              if (flat >= offset && flat < offset + awkward_units[u][p]) want = original_value(u, p, flat - offset);
            RANK_CHECK(shard[i] == want, "init " << init << " unit " << u << " shard element " << i << ": " << shard[i]
                                                 << " want " << want);
          }
        }
        for (auto order : {cohort::prefetch_order::forward, cohort::prefetch_order::backward}) {
          params.set_order(order);
          for (std::size_t k = 0; k < params.unit_count(); ++k) {
            const std::size_t u = order == cohort::prefetch_order::forward ? k : params.unit_count() - 1 - k;
            auto unit = params.gather(u);
            RANK_CHECK(unit.size() == awkward_units[u].size());
            for (std::size_t p = 0; p < unit.size(); ++p) {
              auto values = unit.param(p);
              RANK_CHECK(values.size() == awkward_units[u][p]);
              for (std::size_t i = 0; i < values.size(); ++i)
                RANK_CHECK(values[i] == original_value(u, p, i), "world " << world << " init " << init << " unit " << u
                                                                          << " param " << p << " [" << i
                                                                          << "] = " << values[i]);
            }
          }
        }
        const auto state = params.gather_full_state(0);
        if (rank == 0) RANK_CHECK(state == full, "gather_full_state differs from the original");
        if (rank != 0) RANK_CHECK(state.empty());
      }
    });
  }
}

TEST_CASE("mixed precision: gathered bfloat16 and half are the rounded fp32 masters", "[sharded][gloo]") {
  const std::vector<std::vector<std::size_t>> units{{7, 3}, {10}};
  std::vector<std::vector<float>> full{std::vector<float>(7), std::vector<float>(3), std::vector<float>(10)};
  for (std::size_t t = 0; t < full.size(); ++t)
    for (std::size_t i = 0; i < full[t].size(); ++i) full[t][i] = static_cast<float>(cohort_examples::uniform(t, i));
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(3, [&](int rank) {
    auto pg = make_group(store, rank, 3);
    sharded bf(pg, units, {.gather_type = cohort::dtype::bfloat16});
    sharded hf(pg, units, {.gather_type = cohort::dtype::float16});
    bf.init_from_full(full);
    hf.init_from_full(full);
    std::size_t t = 0;
    for (std::size_t u = 0; u < units.size(); ++u) {
      auto b = bf.gather(u);
      auto h = hf.gather(u);
      RANK_CHECK_THROWS(cohort::error, b.param<float>(0), "gathered as bfloat16");
      for (std::size_t p = 0; p < units[u].size(); ++p, ++t)
        for (std::size_t i = 0; i < units[u][p]; ++i) {
          RANK_CHECK(b.param<cohort::bfloat16>(p)[i] == cohort::bfloat16(full[t][i]));
          RANK_CHECK(h.param<cohort::half>(p)[i] == cohort::half(full[t][i]));
        }
    }
    RANK_CHECK(bf.largest_gather_bytes() == 12 * 2,
               bf.largest_gather_bytes());  // 10 padded to 12 (world 3), 2 bytes each
  });
}

TEST_CASE("release is real: prefetch 1 peaks at shards + gradients + two largest units, and the pool reuses",
          "[sharded][gloo]") {
  // Units of different sizes, the largest in the middle; every size divides by 4 so the
  // gradient reduces in place (no scratch).
  const std::vector<std::vector<std::size_t>> units{{64, 16}, {256, 64}, {512, 128}, {128, 32}, {64, 16}};
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<cohort::sharded_memory> peaks(4);
  std::vector<std::size_t> peak_totals(4), allocations(4), largest(4), live_after(4);
  cohort_test::run_ranks(4, [&](int rank) {
    auto pg = make_group(store, rank, 4);
    sharded params(pg, units, {.prefetch = 1});
    params.init_from_full(make_parameters(units));
    for (int sweep = 0; sweep < 3; ++sweep) {
      params.set_order(cohort::prefetch_order::forward);
      for (std::size_t u = 0; u < units.size(); ++u) {
        auto unit = params.gather(u);
        RANK_CHECK(unit.param(0)[0] == original_value(u, 0, 0));
      }
      params.set_order(cohort::prefetch_order::backward);
      for (std::size_t u = units.size(); u-- > 0;) {
        auto unit = params.gather(u);
        std::vector<float> gradient(params.unit_elements(u), 1.0f);
        params.reduce_scatter_grad(u, gradient).wait();
      }
    }
    peaks[static_cast<std::size_t>(rank)] = params.peak_memory();
    peak_totals[static_cast<std::size_t>(rank)] = params.peak_total();
    allocations[static_cast<std::size_t>(rank)] = params.allocations();
    largest[static_cast<std::size_t>(rank)] = params.largest_gather_bytes();
    live_after[static_cast<std::size_t>(rank)] = params.memory().gathered;
  });
  // Sizes computed directly: a unit of n elements holds n/4 per rank.
  std::size_t shard_bytes = 0;
  std::vector<std::size_t> gathered_bytes;
  for (const auto& u : units) {
    std::size_t n = 0;
    for (auto s : u) n += s;
    shard_bytes += n / 4 * sizeof(float);
    gathered_bytes.push_back(n * sizeof(float));
  }
  std::sort(gathered_bytes.rbegin(), gathered_bytes.rend());
  const std::size_t bound = 2 * shard_bytes + gathered_bytes[0] + gathered_bytes[1];
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    CHECK(peaks[r].shards == shard_bytes);
    CHECK(peaks[r].gradients == shard_bytes);
    CHECK(largest[r] == gathered_bytes[0]);
    CHECK(peak_totals[r] <= bound);
    CHECK(peaks[r].gathered <= gathered_bytes[0] + gathered_bytes[1]);
    // 30 gathers; after the first sweep the pool serves them from buffers it keeps.
    CHECK(allocations[r] <= 6);
    CHECK(live_after[r] == 0);
  }
}

TEST_CASE("an explicit gather limit defers prefetches and fails a gather that cannot fit", "[sharded][gloo]") {
  const std::vector<std::vector<std::size_t>> units{{100}, {100}, {100}, {100}};
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = make_group(store, rank, 2);
    // Room for two units of 400 bytes: prefetch depth 3 is clipped by the limit.
    sharded params(pg, units, {.prefetch = 3, .max_gathered_bytes = 800, .limit_wait = 200ms});
    params.init_from_full(make_parameters(units));
    for (std::size_t u = 0; u < units.size(); ++u) {
      auto unit = params.gather(u);
      RANK_CHECK(params.memory().gathered <= 800, "live " << params.memory().gathered);
      RANK_CHECK(unit.param(0)[99] == original_value(u, 0, 99));
    }
    RANK_CHECK(params.peak_memory().gathered <= 800);
    auto a = params.gather(0);
    auto b = params.gather(1);
    RANK_CHECK_THROWS(cohort::error, params.gather(2), "past the limit");
  });
}

TEST_CASE("reduce_scatter_grad leaves each rank its slice of the averaged gradient", "[sharded][gloo]") {
  auto contribution = [](int rank, std::size_t unit, std::size_t index) {
    return static_cast<float>((rank + 1) * 3 + static_cast<int>(unit)) + static_cast<float>(index % 17) * 0.5f;
  };
  for (int world : {2, 3, 4}) {
    auto store = std::make_shared<cohort::memory_store>();
    cohort_test::run_ranks(world, [&](int rank) {
      auto pg = make_group(store, rank, world);
      for (auto reduce : {cohort::dtype::float32, cohort::dtype::float64}) {
        sharded params(pg, awkward_units, {.reduce_type = reduce, .replicate_below = 2});
        for (std::size_t u = 0; u < params.unit_count(); ++u) {
          const std::size_t n = params.unit_elements(u);
          std::vector<float> gradient(n);
          for (std::size_t i = 0; i < n; ++i) gradient[i] = contribution(rank, u, i);
          // Flat, then per parameter accumulated on top: the result is twice the average.
          params.reduce_scatter_grad(u, gradient).wait();
          std::vector<std::vector<float>> parts;
          std::size_t offset = 0;
          for (std::size_t size : awkward_units[u]) {
            parts.emplace_back(gradient.begin() + static_cast<std::ptrdiff_t>(offset),
                               gradient.begin() + static_cast<std::ptrdiff_t>(offset + size));
            offset += size;
          }
          params.reduce_scatter_grad(u, parts, true).wait();
          auto shard = params.grad_shard(u);
          RANK_CHECK(params.replicated(u) == (n < 2), "unit " << u);
          for (std::size_t i = 0; i < shard.size(); ++i) {
            const std::size_t flat = params.shard_offset(u) + i;
            double want = 0;
            if (flat < n) {
              for (int r = 0; r < world; ++r) want += contribution(r, u, flat);
              want = 2 * want / world;
            }
            RANK_CHECK(
                std::abs(shard[i] - want) <= 1e-5 * std::max(1.0, std::abs(want)),
                "world " << world << " unit " << u << " element " << flat << ": " << shard[i] << " want " << want);
          }
        }
        // Wrong sizes are clear errors.
        std::vector<float> wrong(3);
        RANK_CHECK_THROWS(cohort::error, params.reduce_scatter_grad(3, wrong),
                          "has 31 elements but the gradient has 3");
        const auto traffic = params.traffic();
        RANK_CHECK(traffic.reductions > 0 && traffic.reduce_bytes > 0);
      }
    });
  }
}

// ---- training equivalence ------------------------------------------------------------------

namespace {

enum class optimizer_kind { sgd, adam };
const std::vector<std::size_t> widths{6, 10, 7, 3};
constexpr std::size_t batch = 12;  // divisible by 2, 3 and 4
constexpr std::uint64_t seed = 42;
constexpr double sgd_lr = 0.1, sgd_momentum = 0.9;
constexpr double adam_lr = 0.01, adam_beta1 = 0.9, adam_beta2 = 0.999, adam_eps = 1e-8;

cohort_examples::synthetic_data training_data(int steps) {
  return cohort_examples::synthetic_data::make(batch * static_cast<std::size_t>(steps), widths.front(), widths.back(),
                                               7);
}

std::vector<std::vector<std::size_t>> layer_units(const cohort_examples::mlp& model) {
  const auto sizes = model.parameter_sizes();
  std::vector<std::vector<std::size_t>> units;
  for (std::size_t l = 0; l < model.layers(); ++l) units.push_back({sizes[2 * l], sizes[2 * l + 1]});
  return units;
}

std::vector<std::vector<float>> initial_parameters(const cohort_examples::mlp& model) {
  std::vector<std::vector<float>> params;
  for (auto size : model.parameter_sizes()) params.emplace_back(size);
  std::vector<std::span<float>> spans(params.begin(), params.end());
  model.initialize(spans, seed);
  return params;
}

// The optimizers written out here, on full buffers (step t counts from 1).
struct reference_optimizer {
  optimizer_kind kind;
  std::vector<std::vector<float>> state1, state2;

  reference_optimizer(optimizer_kind k, const std::vector<std::vector<float>>& params) : kind(k) {
    for (auto& p : params) {
      state1.emplace_back(p.size(), 0.0f);
      state2.emplace_back(p.size(), 0.0f);
    }
  }
  void update(std::vector<std::vector<float>>& params, const std::vector<std::span<float>>& grads, int t) {
    for (std::size_t k = 0; k < params.size(); ++k)
      for (std::size_t i = 0; i < params[k].size(); ++i) {
        const float g = grads[k][i];
        if (kind == optimizer_kind::sgd) {
          state1[k][i] = static_cast<float>(sgd_momentum) * state1[k][i] + g;
          params[k][i] -= static_cast<float>(sgd_lr) * state1[k][i];
        } else {
          float& m = state1[k][i];
          float& v = state2[k][i];
          m = static_cast<float>(adam_beta1) * m + static_cast<float>(1 - adam_beta1) * g;
          v = static_cast<float>(adam_beta2) * v + static_cast<float>(1 - adam_beta2) * g * g;
          const float m_hat = m / static_cast<float>(1 - std::pow(adam_beta1, t));
          const float v_hat = v / static_cast<float>(1 - std::pow(adam_beta2, t));
          params[k][i] -= static_cast<float>(adam_lr) * (m_hat / (std::sqrt(v_hat) + static_cast<float>(adam_eps)));
        }
      }
  }
};

// Single-rank training on the whole batch.
std::vector<std::vector<float>> reference_training(optimizer_kind kind, int steps) {
  cohort_examples::mlp model(widths);
  auto params = initial_parameters(model);
  const auto data = training_data(steps);
  std::vector<std::vector<float>> grads;
  for (auto& p : params) grads.emplace_back(p.size());
  reference_optimizer opt(kind, params);
  for (int step = 0; step < steps; ++step) {
    std::vector<std::span<float>> p_spans(params.begin(), params.end()), g_spans(grads.begin(), grads.end());
    const std::size_t first = static_cast<std::size_t>(step) * batch;
    model.loss_and_gradients(p_spans, g_spans, std::span<const float>(data.inputs).subspan(first * widths.front()),
                             std::span<const float>(data.targets).subspan(first * widths.back()), batch);
    opt.update(params, g_spans, step + 1);
  }
  return params;
}

#if __has_include("cohort/reducer.hpp")
#define COHORT_TEST_HAS_REDUCER 1
// Data-parallel training with the gradient reducer (full replicas, averaged gradients) and
// the same optimizer math on full buffers.
std::vector<std::vector<float>> reducer_training(optimizer_kind kind, int world, int steps) {
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::vector<float>> result;
  const auto data = training_data(steps);
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world);
    cohort_examples::mlp model(widths);
    auto params = initial_parameters(model);
    cohort::gradient_reducer<cohort::gloo> ddp(pg, model.parameter_sizes(),
                                               {.first_bucket_bytes = 256, .bucket_bytes = 512});
    reference_optimizer opt(kind, params);
    const std::size_t local = batch / static_cast<std::size_t>(world);
    for (int step = 0; step < steps; ++step) {
      std::vector<std::span<float>> p_spans(params.begin(), params.end());
      auto grads = ddp.gradients();
      const std::size_t sample = static_cast<std::size_t>(step) * batch + static_cast<std::size_t>(rank) * local;
      model.loss_and_gradients(p_spans, grads, std::span<const float>(data.inputs).subspan(sample * widths.front()),
                               std::span<const float>(data.targets).subspan(sample * widths.back()), local,
                               [&](std::size_t t) { ddp.mark_ready(t); });
      ddp.finish();
      opt.update(params, std::vector<std::span<float>>(grads.begin(), grads.end()), step + 1);
    }
    if (rank == 0) result = params;
  });
  return result;
}
#endif

struct training_run {
  optimizer_kind kind = optimizer_kind::sgd;
  int world = 2;
  int first_step = 0;
  int last_step = 4;  // exclusive
  cohort::sharded_options options{.prefetch = 1};
  bool hybrid = false;  // world 4: shard over pairs, replicate across them
  std::string load_from;
  std::string save_to;
};

template <class Optimizer>
void train_steps(sharded& params, Optimizer& opt, const cohort_examples::mlp& model,
                 const cohort_examples::synthetic_data& data, int global_rank, int global_world, int first, int last) {
  const std::size_t local = batch / static_cast<std::size_t>(global_world);
  const std::size_t layers = model.layers();
  std::vector<std::vector<float>> grads;
  for (auto size : model.parameter_sizes()) grads.emplace_back(size);
  for (int step = first; step < last; ++step) {
    params.set_order(cohort::prefetch_order::forward);
    std::vector<sharded::gathered> guards;
    std::vector<std::span<float>> p_spans;
    for (std::size_t l = 0; l < layers; ++l) {
      guards.push_back(params.gather(l));
      for (auto s : guards.back().params()) p_spans.push_back(s);
    }
    params.set_order(cohort::prefetch_order::backward);
    std::vector<sharded::work> reductions;
    std::vector<std::span<float>> g_spans(grads.begin(), grads.end());
    const std::size_t sample = static_cast<std::size_t>(step) * batch + static_cast<std::size_t>(global_rank) * local;
    model.loss_and_gradients(p_spans, g_spans, std::span<const float>(data.inputs).subspan(sample * widths.front()),
                             std::span<const float>(data.targets).subspan(sample * widths.back()), local,
                             [&](std::size_t t) {
                               const std::size_t l = t / 2;
                               if (t % 2 == 1 && l + 1 < layers)
                                 guards[l + 1].reset();  // layer l+1's weights no longer read
                               if (t % 2 == 0) {
                                 const std::vector<std::span<const float>> unit_grads{grads[2 * l], grads[2 * l + 1]};
                                 reductions.push_back(params.reduce_scatter_grad(l, unit_grads));
                               }
                               if (t == 0) guards[0].reset();
                             });
    for (auto& w : reductions) w.wait();
    opt.step().wait();
  }
}

std::vector<std::vector<float>> sharded_training(const training_run& run) {
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::vector<float>> result;
  cohort_test::run_ranks(run.world, [&](int rank) {
    auto pg = make_group(store, rank, run.world);
    std::optional<group> shard_group, replica_group;
    group* shards = &pg;
    group* replicas = nullptr;
    if (run.hybrid) {
      shard_group = pg.split(rank / 2, rank);
      replica_group = pg.split(rank % 2, rank);
      shards = &*shard_group;
      replicas = &*replica_group;
    }
    cohort_examples::mlp model(widths);
    sharded params(*shards, layer_units(model), run.options, replicas);
    if (run.load_from.empty())
      params.scatter_from(0, shards->rank() == 0 ? initial_parameters(model) : std::vector<std::vector<float>>{});
    const auto data = training_data(run.last_step);
    auto go = [&](auto& opt) {
      if (!run.load_from.empty()) params.load_sharded(run.load_from, &opt);
      train_steps(params, opt, model, data, rank, run.world, run.first_step, run.last_step);
      if (!run.save_to.empty()) params.save_sharded(run.save_to, &opt);
    };
    if (run.kind == optimizer_kind::sgd) {
      cohort::sgd opt(params, {.lr = sgd_lr, .momentum = sgd_momentum});
      go(opt);
    } else {
      cohort::adam opt(params, {.lr = adam_lr, .beta1 = adam_beta1, .beta2 = adam_beta2, .eps = adam_eps});
      go(opt);
    }
    auto state = params.gather_full_state(0);
    if (rank == 0) result = std::move(state);
    RANK_CHECK(params.memory().gathered == 0, "guards left alive after training");
  });
  return result;
}

double max_abs_diff(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return INFINITY;
  double worst = 0;
  for (std::size_t k = 0; k < a.size(); ++k) {
    if (a[k].size() != b[k].size()) return INFINITY;
    for (std::size_t i = 0; i < a[k].size(); ++i) worst = std::max(worst, std::abs(double(a[k][i]) - b[k][i]));
  }
  return worst;
}

const char* name_of(optimizer_kind kind) { return kind == optimizer_kind::sgd ? "sgd" : "adam"; }

}  // namespace

TEST_CASE("training with sharded parameters on 2, 3, 4 ranks equals single-rank training", "[sharded][gloo]") {
  for (auto kind : {optimizer_kind::sgd, optimizer_kind::adam}) {
    const auto reference = reference_training(kind, 4);
    const auto initial = initial_parameters(cohort_examples::mlp(widths));
    REQUIRE(max_abs_diff(reference, initial) > 1e-3);  // training moved the weights
    for (int world : {2, 3, 4}) {
      training_run run;
      run.kind = kind;
      run.world = world;
      const auto got = sharded_training(run);
      INFO(name_of(kind) << " on " << world << " ranks");
      CHECK(max_abs_diff(got, reference) <= 1e-5);
#if COHORT_TEST_HAS_REDUCER
      // And the data-parallel reducer's result on the same ranks.
      CHECK(max_abs_diff(got, reducer_training(kind, world, 4)) <= 1e-5);
#endif
    }
  }
}

TEST_CASE("replicated small units and a double reduce dtype train identically too", "[sharded][gloo]") {
  const auto reference = reference_training(optimizer_kind::adam, 4);
  training_run run;
  run.kind = optimizer_kind::adam;
  run.world = 3;
  // The last layer (7x3 + 3 = 24 elements) is replicated; prefetch 2 with an explicit limit.
  run.options = {
      .prefetch = 2, .max_gathered_bytes = 4096, .reduce_type = cohort::dtype::float64, .replicate_below = 30};
  CHECK(max_abs_diff(sharded_training(run), reference) <= 1e-5);
}

TEST_CASE("a 4-rank sharded checkpoint loads onto 2 ranks and training continues identically", "[sharded][gloo]") {
  for (auto kind : {optimizer_kind::sgd, optimizer_kind::adam}) {
    const auto reference = reference_training(kind, 4);
    const auto directory = temporary_directory(name_of(kind));
    training_run first;
    first.kind = kind;
    first.world = 4;
    first.last_step = 2;
    first.save_to = directory;
    const auto halfway = sharded_training(first);
    CHECK(max_abs_diff(halfway, reference_training(kind, 2)) <= 1e-5);
    CHECK(fs::exists(fs::path(directory) / "shard-3-of-4.bin"));
    training_run second;
    second.kind = kind;
    second.world = 2;
    second.first_step = 2;
    second.last_step = 4;
    second.load_from = directory;
    const auto resumed = sharded_training(second);
    INFO(name_of(kind));
    CHECK(max_abs_diff(resumed, reference) <= 1e-5);
    fs::remove_all(directory);
  }
}

TEST_CASE("loading a checkpoint into another model or optimizer is a clear error", "[sharded][gloo]") {
  const auto directory = temporary_directory("mismatch");
  training_run run;
  run.world = 2;
  run.last_step = 1;
  run.save_to = directory;
  sharded_training(run);
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = make_group(store, rank, 2);
    sharded other(pg, {{60, 10}, {70, 7}, {21, 2}});
    RANK_CHECK_THROWS(cohort::error, other.load_sharded(directory), "unit 2 saved with sizes [21, 3], here [21, 2]");
    cohort_examples::mlp model(widths);
    sharded same(pg, layer_units(model));
    cohort::adam opt(same);
    RANK_CHECK_THROWS(cohort::error, same.load_sharded(directory, &opt), "optimizer state saved for 'sgd'");
  });
  fs::remove_all(directory);
}

TEST_CASE("hybrid sharding 2 x 2 equals plain sharding on 4 ranks", "[sharded][gloo]") {
  for (auto kind : {optimizer_kind::sgd, optimizer_kind::adam}) {
    training_run plain;
    plain.kind = kind;
    plain.world = 4;
    training_run hybrid = plain;
    hybrid.hybrid = true;
    const auto a = sharded_training(plain);
    const auto b = sharded_training(hybrid);
    INFO(name_of(kind));
    CHECK(max_abs_diff(a, b) <= 1e-5);
    CHECK(max_abs_diff(b, reference_training(kind, 4)) <= 1e-5);
  }
}

#else

TEST_CASE("sharded parameters need Gloo", "[sharded]") { cohort_test::skip("built without Gloo (libgloo-dev)"); }

#endif
