// training_state: one trainer, four strategies. The same training loop runs under ddp,
// zero1, zero2 and zero3 at 2, 3 and 4 ranks (threads with Gloo contexts over loopback) and
// must equal a single process computing the same thing on its own, in double: AdamW with
// per-region weight decay and learning-rate scales, clipping by the global norm, a loss
// scaler whose skip every rank takes together, ranks marking in different orders and one
// rank leaving a region unused. Then the layout's own rules, the accounting, and the errors.

// Other specializations than the default library's (double parameters, bfloat16 with fp32
// gradients): this unit compiles training_state's and the checkpoint's bodies itself.
#define COHORT_TEMPLATE_BODIES

#include <catch2/catch.hpp>

#include <cohort/comm/host_values.hpp>
#include <cohort/parallel/training_state.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "flat_fixtures.hpp"
#include "support.hpp"

namespace {

using cohort::region;
using cohort::strategy;

// llm.c's layout, smaller: an embedding, then two tensors stacked over the layers.
std::vector<region> model_regions() {
  std::vector<region> regions{{"embedding", 0, 23, 0, true, 1.0}};
  auto stacked = cohort::stacked_regions({{"w", 37, true}, {"b", 5, false}}, 4, 1, 23);
  stacked[1].lr_scale = 0.5;  // a parameter group of its own
  regions.insert(regions.end(), stacked.begin(), stacked.end());
  return regions;
}

// The bus bytes of gathering model_regions()'s top layer at zero3: its regions sit apart in
// the buffer (a stacked w and b), each its own range, whose chunks (count / world) every rank
// all-gathers: (world - 1) chunks received per range.
std::size_t top_layer_gather_bytes(std::size_t world) {
  const auto regions = model_regions();
  std::size_t top = 0, bytes = 0;
  for (const auto& r : regions) top = std::max(top, r.layer);
  for (const auto& r : regions)
    if (r.layer == top) bytes += (world - 1) * (r.count / world) * sizeof(double);
  return bytes;
}

constexpr std::size_t samples_per_rank = 3;

double target(std::size_t sample, std::size_t element) {
  return std::sin(0.37 * static_cast<double>(sample) + 0.11 * static_cast<double>(element));
}
double weight(std::size_t element) { return 1.0 + static_cast<double>(element % 3); }

// Rank k's gradient of its batch at `batch` (a step's micro-batch), for the elements
// [offset, offset + count) of the flat buffer: mean over its samples of weight x (parameter -
// target).
void rank_gradient(std::size_t batch, int rank, int world, const double* params, std::size_t offset, std::size_t count,
                   double* out) {
  const std::size_t first =
      (batch * static_cast<std::size_t>(world) + static_cast<std::size_t>(rank)) * samples_per_rank;
  for (std::size_t j = 0; j < count; ++j) {
    double sum = 0;
    for (std::size_t s = first; s < first + samples_per_rank; ++s)
      sum += weight(offset + j) * (params[j] - target(s, offset + j));
    out[j] = sum / samples_per_rank;
  }
}

std::vector<double> initial_parameters(std::size_t n) {
  std::vector<double> p(n);
  for (std::size_t i = 0; i < n; ++i) p[i] = 0.5 * std::cos(0.7 * static_cast<double>(i));
  return p;
}

struct scenario {
  int world = 2;
  strategy kind = strategy::ddp;
  int steps = 6;
  int inf_step = 3;               // rank 0 puts an inf into this step's gradient
  std::size_t unused_region = 4;  // rank 1 never writes or marks it
  std::size_t bucket_bytes = 600;
  int accumulation = 1;            // micro-steps per step, all but the last under no_sync
  bool sgd = false;                // SGD with momentum and weight decay instead of AdamW
  bool adopted = false;            // the trainer's own flat buffers, adopted where they are
  bool trainer_optimizer = false;  // the trainer's own AdamW (or SGD) over owned_spans()
  // The embedding (layer 0) read again for the logits after the last layer, and first in the
  // backward, as a model with tied weights does; `tied_rank`: only that rank does (-1: all).
  bool tied = false;
  int tied_rank = -1;
  int evaluation_passes = 0;  // forward-only passes after each step, inside evaluation()
};

// How a scenario keeps its buffers and optimizer, for messages.
std::string mode(const scenario& s) {
  return std::string(s.adopted ? "adopted buffers" : "owned buffers") +
         (s.trainer_optimizer ? ", the trainer's optimizer" : ", the state's optimizer");
}
// The modes every scenario runs in: the state's buffers and optimizer, the trainer's buffers
// with the state's optimizer, the state's buffers with the trainer's optimizer, and the
// trainer's buffers and optimizer.
std::vector<scenario> in_every_mode(scenario s) {
  std::vector<scenario> out;
  for (const auto& [adopted, own] : {std::pair{false, false}, {true, false}, {false, true}, {true, true}}) {
    s.adopted = adopted;
    s.trainer_optimizer = own;
    out.push_back(s);
  }
  return out;
}

cohort::training_options options_for(const scenario& s) {
  cohort::training_options o;
  o.strategy = s.kind;
  o.bucket_bytes = s.bucket_bytes;
  o.adam = {.lr = 0.05, .beta1 = 0.9, .beta2 = 0.99, .eps = 1e-8, .weight_decay = 0.1};
  o.max_grad_norm = 0.4;  // active: the gradients' norm is well above it
  if (s.sgd) o.sgd = cohort::sgd_options{.lr = 0.05, .momentum = 0.9, .weight_decay = 0.1};
  o.trainer_optimizer = s.trainer_optimizer;
  // The trainer below reads its parameters through gather() only: its own buffer may be
  // published as the state's is (zero1/zero2), with the state's optimizer; with its own, the
  // publication is waited for in publish_parameters() (the default).
  o.defer_publication = s.adopted && !s.trainer_optimizer;
  return o;
}

// A trainer's own optimizer, written as a trainer writes it (in double, as the reference):
// over the spans this rank updates, its state indexed by each span's owned position.
struct trainer_optimizer {
  cohort::training_options options;
  std::vector<region> regions;
  std::vector<double> m, v;
  int t = 0;
  void update(const std::vector<cohort::training_state<cohort::gloo, double>::owned_span>& spans,
              const cohort::step_result& result) {
    ++t;
    const auto& o = options.adam;
    for (const auto& s : spans) {
      const region& r = regions[s.region];
      for (std::size_t j = 0; j < s.parameters.size(); ++j) {
        const double g = s.gradients[j] * result.gradient_scale;
        double& p = s.parameters[j];
        double &first = m.at(s.owned + j), &second = v.at(s.owned + j);
        if (options.sgd) {
          first = options.sgd->momentum * first + g + (r.decay ? options.sgd->weight_decay : 0.0) * p;
          p -= options.sgd->lr * r.lr_scale * first;
          continue;
        }
        first = o.beta1 * first + (1 - o.beta1) * g;
        second = o.beta2 * second + (1 - o.beta2) * g * g;
        const double mh = first / (1 - std::pow(o.beta1, t)), vh = second / (1 - std::pow(o.beta2, t));
        p -= o.lr * r.lr_scale * (mh / (std::sqrt(vh) + o.eps) + (r.decay ? o.weight_decay : 0.0) * p);
      }
    }
  }
};

// One process, everything written out: what the distributed run must equal.
std::vector<double> reference(const scenario& s) {
  const auto regions = model_regions();
  const std::size_t n = regions.back().offset + regions.back().count;
  auto params = initial_parameters(n);
  std::vector<double> m(n), v(n), gradient(n), part(n);
  const auto o = options_for(s);
  int t = 0;  // Adam's steps: the skipped one is not one (the loss scale only scales, exactly in double)
  for (int step = 0; step < s.steps; ++step) {
    std::fill(gradient.begin(), gradient.end(), 0.0);
    for (int micro = 0; micro < s.accumulation; ++micro)
      for (int rank = 0; rank < s.world; ++rank) {
        rank_gradient(static_cast<std::size_t>(step * s.accumulation + micro), rank, s.world, params.data(), 0, n,
                      part.data());
        if (rank == 1 && s.world > 1)
          for (std::size_t j = 0; j < regions[s.unused_region].count; ++j)
            part[regions[s.unused_region].offset + j] = 0;
        for (std::size_t i = 0; i < n; ++i) gradient[i] += part[i] / s.world;
      }
    if (step == s.inf_step) continue;  // skipped by everyone
    double squares = 0;
    for (double g : gradient) squares += g * g;
    const double norm = std::sqrt(squares);
    const double clip = norm > o.max_grad_norm ? o.max_grad_norm / (norm + 1e-6) : 1.0;
    ++t;
    for (const auto& r : regions)
      for (std::size_t j = r.offset; j < r.offset + r.count; ++j) {
        const double g = gradient[j] * clip;
        if (s.sgd) {  // PyTorch's SGD: decay added to the gradient, then momentum
          const auto& sgd = *o.sgd;
          m[j] = sgd.momentum * m[j] + g + (r.decay ? sgd.weight_decay : 0.0) * params[j];
          params[j] -= sgd.lr * r.lr_scale * m[j];
          continue;
        }
        m[j] = o.adam.beta1 * m[j] + (1 - o.adam.beta1) * g;
        v[j] = o.adam.beta2 * v[j] + (1 - o.adam.beta2) * g * g;
        const double mh = m[j] / (1 - std::pow(o.adam.beta1, t)), vh = v[j] / (1 - std::pow(o.adam.beta2, t));
        params[j] -= o.adam.lr * r.lr_scale *
                     (mh / (std::sqrt(vh) + o.adam.eps) + (r.decay ? o.adam.weight_decay : 0.0) * params[j]);
      }
  }
  return params;
}

// The trainer: the same source for every strategy. Ranks walk the layers and their regions in
// different orders; rank 1 leaves one region unused; rank 0 sends an inf at one step.
// Hybrid sharding: the state lives on `shards` and averages across `replicas`; `pg` is the
// whole world, whose rank picks the batch. `wire`: the last step's wire bytes; `overlapped`:
// the fewest buckets any step reduced before step() (what overlapped the backward);
// `evaluation_wire`: the bytes of the evaluation passes.
struct hybrid_groups {
  cohort_test::gloo_group* shards = nullptr;
  cohort_test::gloo_group* replicas = nullptr;
  std::size_t* wire = nullptr;
  std::size_t* overlapped = nullptr;
  std::size_t* evaluation_wire = nullptr;
};

std::vector<double> train(const scenario& s, cohort_test::gloo_group& pg, std::vector<std::size_t>* launches,
                          hybrid_groups hybrid = {}) {
  auto regions = model_regions();
  const std::size_t n = regions.back().offset + regions.back().count;
  cohort::loss_scaler scaler({.initial_scale = 1024, .growth_factor = 2, .backoff_factor = 0.5, .growth_interval = 3});
  auto options = options_for(s);
  options.scaler = &scaler;
  if (launches) options.on_launch = [launches](std::size_t b) { launches->push_back(b); };
  using state_type = cohort::training_state<cohort::gloo, double>;
  auto& group = hybrid.shards ? *hybrid.shards : pg;
  const int rank = pg.rank();
  // Adopted: the trainer's buffers, in its order, the parameters already initialised. Rank 1
  // allocates its gradients in its first backward, as many C trainers do, and binds them then.
  const bool lazy_gradients = s.adopted && rank == 1;
  std::vector<double> parameters = initial_parameters(n), gradients(lazy_gradients ? 0 : n, 0.0);
  std::optional<state_type> held;
  if (s.adopted)
    held.emplace(group, std::span<double>(parameters), std::span<double>(gradients), regions, options, hybrid.replicas);
  else
    held.emplace(group, regions, options, hybrid.replicas);
  state_type& state = *held;
  if (!s.adopted) state.load_parameters(initial_parameters(n));
  trainer_optimizer own{options, regions, std::vector<double>(state.owned_elements()),
                        std::vector<double>(state.owned_elements())};
  std::vector<std::size_t> layers(state.layer_count());
  std::iota(layers.begin(), layers.end(), std::size_t{0});
  std::reverse(layers.begin(), layers.end());
  // Rank 2 marks in forward order, where the layers are not gathered: at zero3 the gathers are
  // collectives, which every rank issues in the same order.
  if (rank == 2 && s.kind != strategy::zero3) std::reverse(layers.begin(), layers.end());
  std::vector<double> scratch;
  const auto micro_step = [&](int step, int micro) {
    // The forward reads every layer (at zero3 gathered, prefetching the next).
    double checksum = 0;
    for (std::size_t l = 0; l < state.layer_count(); ++l) {
      auto layer = state.gather(l);
      for (std::size_t r = 0; r < regions.size(); ++r)
        if (regions[r].layer == l) checksum += layer.param(r)[0];
    }
    RANK_CHECK(std::isfinite(checksum));
    if (gradients.empty()) {  // the first backward
      gradients.assign(n, 0.0);
      state.bind_gradients(gradients);
    }
    const bool tied = s.tied && (s.tied_rank < 0 || s.tied_rank == rank);
    if (tied) (void)state.gather(0).param(0);  // the logits read the embedding again
    std::optional<state_type::layer_view> logits;
    if (tied) logits = state.gather(0);  // and its backward begins with it, held to the end
    for (const std::size_t l : layers) {
      auto layer = state.gather(l);
      std::vector<std::size_t> mine;
      for (std::size_t r = 0; r < regions.size(); ++r)
        if (regions[r].layer == l) mine.push_back(r);
      if (rank == 1) std::reverse(mine.begin(), mine.end());
      for (const std::size_t r : mine) {
        if (rank == 1 && r == s.unused_region && s.world > 1) continue;
        auto gradient = state.gradient(r);
        const auto p = layer.param(r);
        if (s.adopted) {  // the trainer's own pointers: its buffers, in its order (zero3: gathered there)
          RANK_CHECK(gradient.data() == gradients.data() + regions[r].offset);
          RANK_CHECK(p.data() == parameters.data() + regions[r].offset);
        }
        scratch.resize(regions[r].count);
        rank_gradient(static_cast<std::size_t>(step * s.accumulation + micro), rank, s.world, p.data(),
                      regions[r].offset, regions[r].count, scratch.data());
        // Added, not written: the micro-steps accumulate. Scaled, as by the trainer's scaled loss.
        for (std::size_t j = 0; j < gradient.size(); ++j) gradient[j] += scratch[j] * scaler.scale();
        if (step == s.inf_step && rank == 0 && r == mine.front()) gradient[0] = std::numeric_limits<double>::infinity();
        state.mark_ready(r);
      }
    }
  };
  for (int step = 0; step < s.steps; ++step) {
    // Adopted gradients are the trainer's to zero, as it always did.
    if (s.adopted) std::fill(gradients.begin(), gradients.end(), 0.0);
    for (int micro = 0; micro + 1 < s.accumulation; ++micro) {
      auto quiet = state.no_sync();
      micro_step(step, micro);
    }
    micro_step(step, s.accumulation - 1);
    const auto result = state.step();
    if (s.trainer_optimizer) {
      if (!result.skipped) own.update(state.owned_spans(), result);
      state.publish_parameters();
    }
    RANK_CHECK(result.skipped == (step == s.inf_step));
    RANK_CHECK(result.clip_factor <= 1.0);
    if (s.adopted && s.kind == strategy::zero3) {
      // Outside a gather the trainer's buffer holds what this rank holds; the rest is NaN.
      const auto poisoned = std::count_if(parameters.begin(), parameters.end(), [](double p) { return std::isnan(p); });
      RANK_CHECK(static_cast<std::size_t>(poisoned) == n - state.owned_elements());
    }
    if (hybrid.overlapped) *hybrid.overlapped = std::min(*hybrid.overlapped, state.overlapped_buckets());
    if (s.evaluation_passes > 0) {  // forward-only: not a step's, whatever it gathers
      auto evaluating = state.evaluation();
      for (int pass = 0; pass < s.evaluation_passes; ++pass)
        for (std::size_t l = 0; l < state.layer_count(); ++l) {
          auto layer = state.gather(l);
          for (std::size_t r = 0; r < regions.size(); ++r)
            if (regions[r].layer == l) RANK_CHECK(std::isfinite(layer.param(r)[0]));
        }
    }
    if (launches) launches->push_back(~std::size_t{0});  // a step's end
  }
  if (hybrid.wire) *hybrid.wire = state.wire_bytes_per_step();
  if (hybrid.evaluation_wire) *hybrid.evaluation_wire = state.evaluation_wire_bytes();
  return state.gather_parameters();
}

double max_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return a.size() == b.size() ? worst : INFINITY;
}

}  // namespace

TEST_CASE("one trainer source under ddp, zero1, zero2 and zero3 equals one process, at 2, 3 and 4 ranks",
          "[training_state][gloo]") {
  for (const strategy kind : {strategy::ddp, strategy::zero1, strategy::zero2, strategy::zero3})
    for (const int world : {2, 3, 4})
      // Two micro-steps of accumulation at 3 ranks.
      for (const scenario& s : in_every_mode({.world = world, .kind = kind, .accumulation = world == 3 ? 2 : 1})) {
        const auto expected = reference(s);
        std::vector<std::vector<double>> results(static_cast<std::size_t>(world));
        auto store = std::make_shared<cohort::memory_store>();
        cohort_test::run_ranks(world, [&](int rank) {
          auto pg = cohort_test::make_gloo_group(store, rank, world);
          results[static_cast<std::size_t>(rank)] = train(s, pg, nullptr);
        });
        for (int rank = 0; rank < world; ++rank) {
          INFO(std::string(cohort::to_string(kind)) << " at " << world << " ranks, " << mode(s) << ", rank " << rank);
          CHECK(max_difference(results[static_cast<std::size_t>(rank)], expected) < 1e-9);
        }
      }
}

TEST_CASE("SGD with momentum and weight decay under ddp, zero1, zero2 and zero3 equals one process, at 3 ranks",
          "[training_state][gloo]") {
  for (const strategy kind : {strategy::ddp, strategy::zero1, strategy::zero2, strategy::zero3})
    for (const scenario& s : in_every_mode({.world = 3, .kind = kind, .sgd = true})) {
      const auto expected = reference(s);
      std::vector<std::vector<double>> results(3);
      auto store = std::make_shared<cohort::memory_store>();
      cohort_test::run_ranks(3, [&](int rank) {
        auto pg = cohort_test::make_gloo_group(store, rank, 3);
        results[static_cast<std::size_t>(rank)] = train(s, pg, nullptr);
      });
      for (std::size_t rank = 0; rank < 3; ++rank) {
        INFO(std::string(cohort::to_string(kind)) << ", " << mode(s) << ", rank " << rank);
        CHECK(max_difference(results[rank], expected) < 1e-9);
      }
    }
}

// Hybrid sharding (HSDP) as 2 nodes x 2 ranks in threads: the state sharded inside each pair
// ({0, 1}, {2, 3}) and averaged across the ranks at the same place ({0, 2}, {1, 3}). The same
// trainer equals one process on the 4 ranks' batches, every rank skips the step where rank 0
// alone sends an inf (ranks 2 and 3 hold none of it before the average across replicas),
// and the replicas add only their average of what each rank keeps to the wire bytes.
TEST_CASE("hybrid sharding 2 x 2 under every strategy equals one process on 4 ranks, and skips together",
          "[training_state][gloo][hybrid]") {
  for (const strategy kind : {strategy::ddp, strategy::zero1, strategy::zero2, strategy::zero3})
    for (const scenario& s :
         in_every_mode({.world = 4, .kind = kind, .accumulation = kind == strategy::zero1 ? 2 : 1})) {
      const auto expected = reference(s);
      std::vector<std::vector<double>> results(4);
      std::vector<std::size_t> wire(4), kept(4);
      auto store = std::make_shared<cohort::memory_store>();
      cohort_test::run_ranks(4, [&](int rank) {
        auto pg = cohort_test::make_gloo_group(store, rank, 4);
        auto shards = pg.split(rank / 2, rank);
        auto replicas = pg.split(rank % 2, rank);
        const auto r = static_cast<std::size_t>(rank);
        results[r] = train(s, pg, nullptr, {&*shards, &*replicas, &wire[r]});
        cohort::training_state<cohort::gloo, double> probe(*shards, model_regions(), options_for(s), &*replicas);
        RANK_CHECK(probe.replica_count() == 2);
        kept[r] = probe.owned_elements();
        RANK_CHECK_THROWS(cohort::error, probe.join([] {}), "a join with replicas (hybrid sharding) is not supported");
      });
      for (std::size_t rank = 0; rank < 4; ++rank) {
        INFO(std::string(cohort::to_string(kind)) << ", " << mode(s) << ", rank " << rank);
        CHECK(max_difference(results[rank], expected) < 1e-9);
        // Each rank's group traffic at 2 ranks: the flat buffer's bytes F (ddp's all-reduce; or the
        // reduce-scatter of the chunks and all-reduce of the remainders, F - C, and the
        // all-gather of the chunks, C, where C = F - kept), at zero3 one more gather of C but the
        // top layer's (held from the forward into the backward); then the average of its kept
        // gradients across 2 replicas: 2 (R - 1) / R x kept.
        const std::size_t flat = 191 * sizeof(double), chunks = flat - kept[rank] * sizeof(double);
        const std::size_t group = kind == strategy::zero3 ? flat + chunks - top_layer_gather_bytes(2) : flat;
        CHECK(wire[rank] == group + kept[rank] * sizeof(double));
      }
    }
}

// A model with tied weights reads its embedding (layer 0) again for the logits, after the last
// layer, and its backward begins there: at zero3 that must not cost the overlap of the
// backward's reductions, and the result stays one process's.
TEST_CASE("at zero3 a tied embedding gathered again in the forward keeps the backward's overlap",
          "[training_state][gloo][zero3]") {
  for (const scenario& s : in_every_mode({.world = 3, .kind = strategy::zero3, .tied = true})) {
    const auto expected = reference(s);
    std::vector<std::vector<double>> results(3);
    std::vector<std::size_t> overlapped(3, ~std::size_t{0});
    std::size_t buckets = 0;
    auto store = std::make_shared<cohort::memory_store>();
    cohort_test::run_ranks(3, [&](int rank) {
      auto pg = cohort_test::make_gloo_group(store, rank, 3);
      const auto r = static_cast<std::size_t>(rank);
      results[r] = train(s, pg, nullptr, {.overlapped = &overlapped[r]});
      if (rank == 0)
        buckets = cohort::training_state<cohort::gloo, double>(pg, model_regions(), options_for(s)).bucket_count();
      else
        (void)cohort::training_state<cohort::gloo, double>(pg, model_regions(), options_for(s));
    });
    for (std::size_t rank = 0; rank < 3; ++rank) {
      INFO(mode(s) << ", rank " << rank);
      CHECK(max_difference(results[rank], expected) < 1e-9);
      // Every bucket but the embedding's (held to the backward's end) reduced during the backward.
      CHECK(buckets >= 4);
      CHECK(overlapped[rank] + 1 >= buckets);
    }
  }
}

// Only rank 1 reads the embedding again: the ranks' gathers differ, which must fail every rank
// within seconds, never train on mispaired data.
TEST_CASE("at zero3 a tied layer on one rank's schedule only fails every rank within seconds",
          "[training_state][gloo][zero3][faults]") {
  const scenario s{.world = 2, .kind = strategy::zero3, .tied = true, .tied_rank = 1};
  std::vector<std::string> errors(2);
  auto store = std::make_shared<cohort::memory_store>();
  const auto started = std::chrono::steady_clock::now();
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 2);
    try {
      (void)train(s, pg, nullptr);
    } catch (const cohort::error& e) {
      errors[static_cast<std::size_t>(rank)] = e.what();
    }
  });
  CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(15));
  // Each names the other's call: gathers of other buckets (other sizes), the same number.
  INFO("rank 0: " << errors[0] << "\nrank 1: " << errors[1]);
  CHECK_THAT(errors[0], Catch::Contains("rank 1 is in all_gather #"));
  CHECK_THAT(errors[1], Catch::Contains("rank 0 is in all_gather #"));
}

// Forward-only passes between steps (evaluation, sampling) inside evaluation(): at zero3 they
// gather every layer, which is neither a forward nor a backward of the step, and their bytes
// are counted apart.
TEST_CASE("evaluation passes between steps leave training one process's, their bytes counted apart",
          "[training_state][gloo]") {
  for (const strategy kind : {strategy::ddp, strategy::zero3})
    for (const scenario& s : in_every_mode({.world = 2, .kind = kind, .evaluation_passes = 3})) {
      const auto expected = reference(s);
      std::vector<std::vector<double>> results(2);
      std::vector<std::size_t> wire(2), plain_wire(2), evaluation(2);
      auto store = std::make_shared<cohort::memory_store>();
      cohort_test::run_ranks(2, [&](int rank) {
        auto pg = cohort_test::make_gloo_group(store, rank, 2);
        const auto r = static_cast<std::size_t>(rank);
        results[r] = train(s, pg, nullptr, {.wire = &wire[r], .evaluation_wire = &evaluation[r]});
        scenario plain = s;
        plain.evaluation_passes = 0;
        (void)train(plain, pg, nullptr, {.wire = &plain_wire[r]});
      });
      for (std::size_t rank = 0; rank < 2; ++rank) {
        INFO(cohort::to_string(kind) << ", " << mode(s) << ", rank " << rank);
        CHECK(max_difference(results[rank], expected) < 1e-9);
        CHECK(wire[rank] == plain_wire[rank]);
        // zero3: 3 passes a step, each gathering every range's chunks once, C bytes (a step at 2
        // ranks: C for the reduce-scatter, the remainders' all-reduce, 2 C of gathers less the
        // top layer's backward one = F + C - top).
        const std::size_t gathered = plain_wire[rank] - 191 * sizeof(double) + top_layer_gather_bytes(2);
        if (kind == strategy::zero3)
          CHECK(evaluation[rank] == static_cast<std::size_t>(s.steps) * 3 * gathered);
        else
          CHECK(evaluation[rank] == 0);
      }
    }
}

TEST_CASE("replicas that do not pair the same places of equal groups fail every rank, naming them",
          "[training_state][gloo][hybrid][faults]") {
  // Groups {0, 1, 2} and {3}: rank 3's replica group {0, 3} pairs rank 0 of 3 with rank 0 of 1.
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::string> errors(4);
  cohort_test::run_ranks(4, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 4);
    auto shards = pg.split(rank < 3 ? 0 : 1, rank);
    auto replicas = pg.split(rank == 3 ? 0 : rank, rank);
    try {
      cohort::training_state<cohort::gloo, double> state(*shards, model_regions(), {.strategy = strategy::zero3},
                                                         &*replicas);
    } catch (const cohort::error& e) {
      errors[static_cast<std::size_t>(rank)] = e.what();
    }
    std::vector<double> one{1.0};
    pg.all_reduce(std::span<double>(one)).wait();  // agreed on, not timed out
  });
  CHECK_THAT(errors[0], Catch::Contains("replica rank 1 is rank 0 of a group of 1, replica rank 0 (this rank) rank 0 "
                                        "of a group of 3"));
  CHECK_THAT(errors[3], Catch::Contains("replica rank 0 is rank 0 of a group of 3, replica rank 1 (this rank) rank 0 "
                                        "of a group of 1"));
  CHECK_THAT(errors[1], Catch::Contains("rank 0 of the group refused its replicas"));
  CHECK_THAT(errors[2], Catch::Contains("rank 0 of the group refused its replicas"));
}

TEST_CASE(
    "the layout: buckets of whole regions in the trainer's order, chunks and remainders covering each element once",
    "[training_state]") {
  const auto regions = model_regions();  // an embedding, then w and b stacked over 4 layers
  for (const int world : {1, 2, 3, 4, 7})
    for (const bool merge : {true, false}) {
      const auto layout = cohort::detail::plan_layout(regions, world, 75, merge);
      INFO("world " << world << (merge ? ", layers merged" : ", a bucket per layer"));
      CHECK(layout.elements == 191);
      for (const auto& bucket : layout.buckets) {
        // A range is whole regions adjacent in the buffer; ranges do not touch each other.
        std::size_t in_ranges = 0;
        for (std::size_t q = 0; q < bucket.ranges.size(); ++q) {
          const auto& range = bucket.ranges[q];
          CHECK(range.chunk == range.count / static_cast<std::size_t>(world));
          CHECK(range.chunk * static_cast<std::size_t>(world) + range.remainder == range.count);
          if (q > 0) CHECK(bucket.ranges[q - 1].offset + bucket.ranges[q - 1].count < range.offset);
          in_ranges += range.count;
        }
        std::size_t in_regions = 0;
        for (const std::size_t r : bucket.regions) {
          in_regions += regions[r].count;
          const auto& range = bucket.ranges[layout.regions[r].range];
          CHECK(regions[r].offset >= range.offset);
          CHECK(regions[r].offset + regions[r].count <= range.offset + range.count);
          CHECK(layout.regions[r].packed == range.packed + (regions[r].offset - range.offset));
          if (!merge) CHECK(regions[r].layer == bucket.layer);
        }
        CHECK(in_ranges == bucket.elements);
        CHECK(in_regions == bucket.elements);
      }
      // Every rank's chunks, and rank 0's remainders, cover each element once; the owned
      // positions of a rank's pieces (chunks and every remainder) are distinct and in range.
      std::vector<int> seen(layout.elements, 0);
      for (int rank = 0; rank < world; ++rank) {
        for (const auto& s : cohort::detail::chunk_segments(regions, layout, rank, rank == 0, false))
          for (std::size_t j = 0; j < s.count; ++j) {
            ++seen[s.offset + j];
            CHECK(s.offset + j >= regions[s.region].offset);
            CHECK(s.offset + j < regions[s.region].offset + regions[s.region].count);
          }
        std::vector<int> owned(layout.owned, 0);
        for (const auto& s : cohort::detail::chunk_segments(regions, layout, rank, true, false))
          for (std::size_t j = 0; j < s.count; ++j) ++owned.at(s.owned + j);
        CHECK(std::all_of(owned.begin(), owned.end(), [](int n) { return n == 1; }));
      }
      CHECK(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
    }
  // The stacked regions keep the trainer's order and its block numbers.
  const auto stacked = cohort::stacked_regions({{"w", 37, true}, {"b", 5, false}}, 4, 1, 23);
  CHECK(stacked[1].name == "w.1");
  CHECK(stacked[1].offset == 23 + 37);
  CHECK(stacked[1].layer == 2);
  CHECK(stacked[5].name == "b.1");
  CHECK(stacked[5].offset == 23 + 4 * 37 + 5);
  // A bucket of one layer (w.1 and b.1) is two ranges of the buffer; of layers 1 and 2 merged, too
  // (merged buckets fill from the last layer down: layers 3 and 4, then 1 and 2, then the rest).
  const auto one_layer = cohort::detail::plan_layout(regions, 2, 42, false);
  CHECK(one_layer.buckets[2].ranges.size() == 2);
  const auto merged = cohort::detail::plan_layout(regions, 2, 84, true);
  CHECK(merged.buckets[2].regions == std::vector<std::size_t>({3, 4, 7, 8}));  // layers 3 and 4
  CHECK(merged.buckets[1].regions == std::vector<std::size_t>({1, 2, 5, 6}));  // layers 1 and 2
  CHECK(merged.buckets[1].ranges.size() == 2);
  CHECK(merged.buckets[1].ranges[0].count == 74);
}

TEST_CASE("regions that leave elements uncovered, overlap or repeat a name are refused, naming them",
          "[training_state]") {
  using cohort::detail::check_regions;
  CHECK(check_regions({{"a", 0, 10}, {"b", 10, 5}}).empty());
  CHECK_THAT(check_regions({{"a", 0, 10}, {"b", 12, 5}}),
             Catch::Contains("elements 10..12 of the 17-element flat buffer belong to no region"));
  CHECK_THAT(check_regions({{"a", 0, 10}, {"b", 8, 5}}),
             Catch::Contains("region 1 'b' (elements 8..13) overlaps region 0 'a' (elements 0..10)"));
  CHECK_THAT(check_regions({{"a", 0, 10}, {"a", 10, 5}}), Catch::Contains("repeats the name 'a'"));
  CHECK_THAT(check_regions({{"a", 0, 0}}), Catch::Contains("is empty"));
  CHECK_THAT(check_regions({{"a", 4, 10}}), Catch::Contains("elements 0..4"));
}

TEST_CASE("a rank whose regions differ, or leave a gap, fails every rank within the timeout, naming it",
          "[training_state][gloo][faults]") {
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::string> errors(3);
  cohort_test::run_ranks(3, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 3);
    auto regions = model_regions();
    if (rank == 2) regions.back().count += 1;  // another model: one element more
    try {
      cohort::training_state<cohort::gloo, double> state(pg, regions, {.strategy = strategy::zero2});
    } catch (const cohort::error& e) {
      errors[static_cast<std::size_t>(rank)] = e.what();
    }
    // The group still works: the failure was agreed on, not timed out.
    std::vector<double> one{1.0};
    pg.all_reduce(std::span<double>(one)).wait();
  });
  CHECK_THAT(errors[0], Catch::Contains("rank 2 has 9 regions over 192 elements, rank 0 9 over 191"));
  CHECK_THAT(errors[1], Catch::Contains("rank 2 has"));
  CHECK_THAT(errors[2], Catch::Contains("rank 2 has"));

  store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 2);
    auto regions = model_regions();
    if (rank == 1) regions.back().offset += 3;  // elements left to no region
    RANK_CHECK_THROWS(cohort::error, (cohort::training_state<cohort::gloo, double>(pg, regions)),
                      rank == 1 ? "belong to no region" : "rank 1 refused its regions");
  });
}

TEST_CASE("misuse is named: a region marked twice, step() inside no_sync, a gradient asked after its reduction",
          "[training_state][gloo]") {
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(1, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 1);
    cohort::training_state<cohort::gloo, double> state(pg, model_regions(),
                                                       {.strategy = strategy::zero2, .bucket_bytes = 600});
    const std::size_t last = model_regions().size() - 1;  // b.4: its bucket launches first
    (void)state.gradient(last);
    state.mark_layer_ready(4);
    RANK_CHECK_THROWS(cohort::error, state.mark_ready(last), "region 8 'b.3' marked twice in one step");
    RANK_CHECK_THROWS(cohort::error, state.gradient(last),
                      "the bucket of region 8 'b.3' was already reduced this step");
    state.step();
    {
      auto quiet = state.no_sync();
      RANK_CHECK_THROWS(cohort::error, state.step(), "step() inside no_sync");
    }
    RANK_CHECK_THROWS(cohort::error, state.region_index("w.9"), "no region is named 'w.9'");
    RANK_CHECK(state.region_index("w.2") == 3);  // the trainer's block 2, in the state's layer 3
  });
}

TEST_CASE("memory and wire bytes per rank are what each strategy promises", "[training_state][gloo]") {
  // A float model of 4 equal layers, a bucket per layer, at 4 ranks.
  std::vector<region> regions;
  for (std::size_t l = 0; l < 4; ++l) regions.push_back({"layer." + std::to_string(l), l * 4096, 4096, l});
  const std::size_t P = 4 * 4096 * sizeof(float);
  const int world = 4;
  std::vector<cohort::training_memory> memory(5);
  std::vector<std::size_t> wire(5);
  // The fifth: zero2 with one reduction in flight instead of two.
  for (const std::size_t run : {0, 1, 2, 3, 4}) {
    const auto kind = static_cast<strategy>(run == 4 ? 2 : run);
    auto store = std::make_shared<cohort::memory_store>();
    cohort_test::run_ranks(world, [&](int rank) {
      auto pg = cohort_test::make_gloo_group(store, rank, world);
      cohort::training_state<cohort::gloo> state(
          pg, regions, {.strategy = kind, .bucket_bytes = 4096 * 4, .reductions_in_flight = run == 4 ? 1 : 2});
      state.load_parameters(std::vector<float>(4 * 4096, 0.25f));
      for (int step = 0; step < 2; ++step) {
        for (std::size_t l = 0; l < 4; ++l) (void)state.gather(l);
        for (std::size_t l = 4; l-- > 0;) {
          auto layer = state.gather(l);
          auto gradient = state.gradient(l);
          std::fill(gradient.begin(), gradient.end(), 0.01f * static_cast<float>(rank + 1));
          state.mark_ready(l);
        }
        state.step();
      }
      if (rank == 0) {
        memory[run] = state.memory();
        wire[run] = state.wire_bytes_per_step();
      }
    });
  }
  const auto &ddp = memory[0], &zero1 = memory[1], &zero2 = memory[2], &zero3 = memory[3], &zero2_one = memory[4];
  const std::size_t n = world;
  // ddp: everything in full (float parameters are their own masters: Adam's two moments).
  CHECK(ddp.parameters == P);
  CHECK(ddp.gradients == P);
  CHECK(ddp.optimizer_state == 2 * P);
  // zero1: optimizer state 1/N.
  CHECK(zero1.parameters == P);
  CHECK(zero1.gradients == P);
  CHECK(zero1.optimizer_state == 2 * P / n);
  // zero2: gradients 1/N too, plus the bucket written and those in flight (reductions_in_flight:
  // the backward here has no compute, so all four would pile up).
  CHECK(zero2.optimizer_state == 2 * P / n);
  CHECK(zero2.gradients <= P / n + 3 * P / 4);
  CHECK(zero2.parameters == P);
  CHECK(zero2_one.gradients <= P / n + 2 * P / 4);
  // zero3: parameters 1/N too, plus the layers in flight (in use and prefetched).
  CHECK(zero3.optimizer_state == 2 * P / n);
  CHECK(zero3.parameters <= P / n + 3 * P / 4);
  CHECK(zero3.parameters < P);
  // Bus bytes: 2(N-1)/N x P, and at zero3 the gathers of forward and backward besides, less
  // the top layer's backward gather (held from the forward's end): (N-1)/N x (3P - P/4).
  CHECK(wire[0] == 2 * (n - 1) * P / n);
  CHECK(wire[1] == 2 * (n - 1) * P / n);
  CHECK(wire[2] == 2 * (n - 1) * P / n);
  CHECK(wire[3] == (n - 1) * (3 * P - P / 4) / n);
}

TEST_CASE("bfloat16 parameters train from fp32 masters, close to the fp32 run", "[training_state][gloo]") {
  std::vector<region> regions{{"w", 0, 300, 0}, {"b", 300, 20, 0, false}, {"v", 320, 100, 1}};
  const auto run = [&]<class P>(P, strategy kind, bool adopted) {
    std::vector<float> result;
    auto store = std::make_shared<cohort::memory_store>();
    cohort_test::run_ranks(2, [&](int rank) {
      auto pg = cohort_test::make_gloo_group(store, rank, 2);
      std::vector<P> initial(420);
      for (std::size_t i = 0; i < initial.size(); ++i) initial[i] = P(0.5f + 0.001f * static_cast<float>(i));
      std::vector<float> gradients(420);  // adopted: the trainer's fp32 gradients beside its bf16 parameters
      std::optional<cohort::training_state<cohort::gloo, P, float>> held;
      const cohort::training_options options{.strategy = kind, .adam = {.lr = 0.01}, .trainer_optimizer = false};
      if (adopted)
        held.emplace(pg, std::span(initial), std::span(gradients), regions, options);
      else
        held.emplace(pg, regions, options);
      auto& state = *held;
      if (!adopted) state.load_parameters(initial);
      for (int step = 0; step < 5; ++step) {
        for (std::size_t l = 2; l-- > 0;) {
          auto layer = state.gather(l);
          for (std::size_t r = 0; r < regions.size(); ++r) {
            if (regions[r].layer != l) continue;
            const auto p = layer.param(r);
            auto g = state.gradient(r);
            for (std::size_t j = 0; j < g.size(); ++j)
              g[j] = static_cast<float>(p[j]) - 0.1f * static_cast<float>(rank);
            state.mark_ready(r);
          }
        }
        state.step();
      }
      const auto params = state.gather_parameters();
      if (rank == 0)
        for (const auto& v : params) result.push_back(static_cast<float>(v));
    });
    return result;
  };
  for (const strategy kind : {strategy::ddp, strategy::zero1, strategy::zero2, strategy::zero3})
    for (const bool adopted : {false, true}) {
      const auto wide = run(float{}, kind, adopted);
      const auto narrow = run(cohort::bfloat16{}, kind, adopted);
      REQUIRE(wide.size() == narrow.size());
      double worst = 0;
      for (std::size_t i = 0; i < wide.size(); ++i) worst = std::max(worst, std::abs(double(wide[i]) - narrow[i]));
      INFO(cohort::to_string(kind) << (adopted ? ", adopted" : ", owned"));
      CHECK(worst < 1e-2);  // bf16 keeps 8 bits of mantissa; the masters keep the steps
      CHECK(worst > 0);
      if (adopted) CHECK(wide == run(float{}, kind, false));  // the same layout: bit for bit
    }
}

namespace {

// How a trainer walks the layers at zero3. The gathers are collectives, so a joined rank must
// answer exactly the ones the ranks with data issue, whichever of these they follow.
enum class gathers {
  usual,       // every layer forward, then backward, each view ended before the next gather
  held,        // the forward's views kept for the backward: one gather per layer and micro-step
  recomputed,  // activation recomputation: the backward gathers a layer for its recomputed
               // forward and, while that view lives, again for the backward itself
  skipping,    // layer 2 left out of both passes (LayerDrop, with a seed every rank shares)
  reordered,   // the backward reaches layer 2 before layer 3 (a branch whose gradient comes first)
};
constexpr std::size_t skipped_layer = 2;

// Uneven inputs: rank k trains batches[k] steps (of `accumulation` micro-steps) inside a join
// scope; the reference averages, at each step, the gradients of the ranks that still had data.
struct uneven {
  std::vector<int> batches;
  strategy kind = strategy::ddp;
  int accumulation = 1;
  bool initial_world_divisor = false;
  gathers pattern = gathers::usual;
  int keeps_views = -1;            // this rank keeps the forward's views while the others gather again
  bool adopted = false;            // the trainer's own buffers
  bool trainer_optimizer = false;  // and its own AdamW
};

std::vector<double> uneven_reference(const uneven& u) {
  const auto regions = model_regions();
  const int world = static_cast<int>(u.batches.size());
  const std::size_t n = regions.back().offset + regions.back().count;
  auto params = initial_parameters(n);
  std::vector<double> m(n), v(n), gradient(n), part(n);
  scenario s{.world = world, .kind = u.kind};
  const auto o = options_for(s);
  const int steps = *std::max_element(u.batches.begin(), u.batches.end());
  for (int t = 0; t < steps; ++t) {
    std::fill(gradient.begin(), gradient.end(), 0.0);
    int contributors = 0;
    for (int rank = 0; rank < world; ++rank) {
      if (u.batches[static_cast<std::size_t>(rank)] <= t) continue;
      ++contributors;
      for (int micro = 0; micro < u.accumulation; ++micro) {
        rank_gradient(static_cast<std::size_t>(t * u.accumulation + micro), rank, world, params.data(), 0, n,
                      part.data());
        if (u.pattern == gathers::skipping)
          for (const auto& r : regions)
            if (r.layer == skipped_layer)
              std::fill_n(part.begin() + static_cast<std::ptrdiff_t>(r.offset), r.count, 0.0);
        for (std::size_t i = 0; i < n; ++i) gradient[i] += part[i];
      }
    }
    const double divisor = u.initial_world_divisor ? world : contributors;
    double squares = 0;
    for (double& g : gradient) {
      g /= divisor;
      squares += g * g;
    }
    const double norm = std::sqrt(squares);
    const double clip = norm > o.max_grad_norm ? o.max_grad_norm / (norm + 1e-6) : 1.0;
    for (const auto& r : regions)
      for (std::size_t j = r.offset; j < r.offset + r.count; ++j) {
        const double g = gradient[j] * clip;
        m[j] = o.adam.beta1 * m[j] + (1 - o.adam.beta1) * g;
        v[j] = o.adam.beta2 * v[j] + (1 - o.adam.beta2) * g * g;
        const double mh = m[j] / (1 - std::pow(o.adam.beta1, t + 1)), vh = v[j] / (1 - std::pow(o.adam.beta2, t + 1));
        params[j] -= o.adam.lr * r.lr_scale *
                     (mh / (std::sqrt(vh) + o.adam.eps) + (r.decay ? o.adam.weight_decay : 0.0) * params[j]);
      }
  }
  return params;
}

std::vector<double> uneven_train(const uneven& u, cohort_test::gloo_group& pg) {
  const auto regions = model_regions();
  const int world = pg.size(), rank = pg.rank();
  scenario s{.world = world, .kind = u.kind, .trainer_optimizer = u.trainer_optimizer};
  std::vector<double> parameters = initial_parameters(regions.back().offset + regions.back().count),
                      gradients(parameters.size());
  std::optional<cohort::training_state<cohort::gloo, double>> held;
  if (u.adopted)
    held.emplace(pg, std::span(parameters), std::span(gradients), regions, options_for(s));
  else
    held.emplace(pg, regions, options_for(s));
  auto& state = *held;
  if (!u.adopted) state.load_parameters(parameters);
  trainer_optimizer own{options_for(s), regions, std::vector<double>(state.owned_elements()),
                        std::vector<double>(state.owned_elements())};
  const auto update = [&](const cohort::step_result& result) { own.update(state.owned_spans(), result); };
  std::vector<double> scratch;
  using layer_view = cohort::training_state<cohort::gloo, double>::layer_view;
  const auto backward = [&](int t, int micro, const layer_view& layer) {
    for (std::size_t r = 0; r < regions.size(); ++r) {
      if (regions[r].layer != layer.layer()) continue;
      auto gradient = state.gradient(r);
      scratch.resize(regions[r].count);
      rank_gradient(static_cast<std::size_t>(t * u.accumulation + micro), rank, world, layer.param(r).data(),
                    regions[r].offset, regions[r].count, scratch.data());
      for (std::size_t j = 0; j < gradient.size(); ++j) gradient[j] += scratch[j];
      state.mark_ready(r);
    }
  };
  const std::size_t layers = state.layer_count();
  const auto used = [&](std::size_t l) { return u.pattern != gathers::skipping || l != skipped_layer; };
  const auto micro_step = [&](int t, int micro) {
    if (u.pattern == gathers::held || rank == u.keeps_views) {
      std::vector<layer_view> views;
      for (std::size_t l = 0; l < layers; ++l) views.push_back(state.gather(l));
      for (std::size_t l = layers; l-- > 0;) {
        backward(t, micro, views[l]);
        views[l].reset();
      }
      return;
    }
    for (std::size_t l = 0; l < layers; ++l)
      if (used(l)) (void)state.gather(l).param(l);  // region l is in layer l
    for (std::size_t k = layers; k-- > 0;) {
      const std::size_t l = u.pattern == gathers::reordered && (k == 2 || k == 3) ? 5 - k : k;
      if (!used(l)) continue;
      auto layer = state.gather(l);
      if (u.pattern == gathers::recomputed) {
        (void)layer.param(l);                // the recomputed forward
        const auto again = state.gather(l);  // the backward's own view, while the first lives
        backward(t, micro, again);
      } else {
        backward(t, micro, layer);
      }
    }
  };
  state.join(
      [&] {
        for (int t = 0; t < u.batches[static_cast<std::size_t>(rank)]; ++t) {
          std::fill(gradients.begin(), gradients.end(), 0.0);  // adopted: the trainer's to zero
          for (int micro = 0; micro + 1 < u.accumulation; ++micro) {
            auto quiet = state.no_sync();
            micro_step(t, micro);
          }
          micro_step(t, u.accumulation - 1);
          const auto result = state.step();
          if (!u.trainer_optimizer) continue;
          if (!result.skipped) update(result);
          state.publish_parameters();
        }
      },
      {.divide_by_initial_world = u.initial_world_divisor,
       .update = u.trainer_optimizer ? std::function<void(const cohort::step_result&)>(update) : nullptr});
  return state.gather_parameters();
}

}  // namespace

TEST_CASE("ranks with 5, 3 and 0 batches (and 7, 7, 6) never hang and equal one process on the union of the batches",
          "[training_state][join][gloo]") {
  std::vector<uneven> cases;
  for (const strategy kind : {strategy::ddp, strategy::zero1, strategy::zero2, strategy::zero3}) {
    cases.push_back({{5, 3, 0}, kind});
    cases.push_back({{7, 7, 6}, kind, 2});  // two micro-steps a step
  }
  cases.push_back({{4, 1, 2}, strategy::ddp, 1, true});                            // DDP's divide_by_initial_world_size
  for (const strategy kind : {strategy::ddp, strategy::zero2, strategy::zero3}) {  // the trainer's buffers
    cases.push_back({.batches = {5, 3, 0}, .kind = kind, .adopted = true});
    cases.push_back({.batches = {5, 3, 0}, .kind = kind, .adopted = true, .trainer_optimizer = true});
  }
  for (const auto& u : cases) {
    const int world = static_cast<int>(u.batches.size());
    const auto expected = uneven_reference(u);
    std::vector<std::vector<double>> results(static_cast<std::size_t>(world));
    auto store = std::make_shared<cohort::memory_store>();
    cohort_test::run_ranks(world, [&](int rank) {
      auto pg = cohort_test::make_gloo_group(store, rank, world);
      results[static_cast<std::size_t>(rank)] = uneven_train(u, pg);
    });
    for (int rank = 0; rank < world; ++rank) {
      INFO(cohort::to_string(u.kind) << " with batches " << u.batches[0] << "," << u.batches[1] << "," << u.batches[2]
                                     << ", accumulation " << u.accumulation << (u.adopted ? ", adopted" : "")
                                     << (u.trainer_optimizer ? ", the trainer's optimizer" : "") << ", rank " << rank);
      CHECK(max_difference(results[static_cast<std::size_t>(rank)], expected) < 1e-9);
    }
  }
}

TEST_CASE(
    "at zero3 a trainer that keeps the forward's views, recomputes activations, skips a layer or reorders its "
    "backward trains under a join scope as one process on the union of the batches",
    "[training_state][join][gloo]") {
  std::vector<uneven> cases;
  for (const gathers pattern : {gathers::held, gathers::recomputed, gathers::skipping, gathers::reordered}) {
    cases.push_back({{5, 3, 0}, strategy::zero3, 1, false, pattern});
    cases.push_back({{7, 7, 6}, strategy::zero3, 2, false, pattern});  // two micro-steps a step
  }
  for (const auto& u : cases) {
    const int world = static_cast<int>(u.batches.size());
    const auto expected = uneven_reference(u);
    std::vector<std::vector<double>> results(static_cast<std::size_t>(world));
    auto store = std::make_shared<cohort::memory_store>();
    const auto started = std::chrono::steady_clock::now();
    cohort_test::run_ranks(world, [&](int rank) {
      auto pg = cohort_test::make_gloo_group(store, rank, world);
      results[static_cast<std::size_t>(rank)] = uneven_train(u, pg);
    });
    // Far below the group's timeout (5 s): nobody waited on a call another rank never made.
    CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(4));
    for (int rank = 0; rank < world; ++rank) {
      INFO("pattern " << static_cast<int>(u.pattern) << " with batches " << u.batches[0] << "," << u.batches[1] << ","
                      << u.batches[2] << ", accumulation " << u.accumulation << ", rank " << rank);
      CHECK(max_difference(results[static_cast<std::size_t>(rank)], expected) < 1e-9);
    }
  }
}

TEST_CASE("at zero3 ranks with data that gather differently while a rank sits out fail together, naming the calls",
          "[training_state][join][gloo][faults]") {
  // Rank 1 kept the forward's views; rank 0 ended them, so at its forward's top layer (4, held
  // into the backward) it prefetches layer 3 for the backward, where rank 1 next reduces layer
  // 4: announced, neither call is issued.
  const uneven u{{2, 2, 0}, strategy::zero3, 1, false, gathers::usual, 1};
  std::vector<std::string> errors(3);
  auto store = std::make_shared<cohort::memory_store>();
  const auto started = std::chrono::steady_clock::now();
  cohort_test::run_ranks(3, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 3);
    try {
      (void)uneven_train(u, pg);
    } catch (const cohort::error& e) {
      errors[static_cast<std::size_t>(rank)] = e.what();
    }
  });
  // At the announcement, not at the group's timeout (5 s).
  CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(4));
  CHECK_THAT(errors[0], Catch::Contains("[rank 0] training_state.join") &&
                            Catch::Contains("this rank's next call at zero3 is the gather of bucket 3, but not every "
                                            "rank with data (2, this one included) announced it"));
  CHECK_THAT(errors[1], Catch::Contains("this rank's next call at zero3 is the reduction of bucket 4"));
  CHECK_THAT(errors[2], Catch::Contains("[rank 2] training_state.join") &&
                            Catch::Contains("the 2 ranks with data announced different calls"));
}

TEST_CASE("a collective of the trainer's own while a rank has joined fails on every rank, naming it",
          "[training_state][join][gloo][faults]") {
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::string> errors(2);
  const auto started = std::chrono::steady_clock::now();
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 2);
    cohort::training_state<cohort::gloo, double> state(pg, model_regions());
    try {
      state.join([&] {
        if (rank == 0) {
          (void)state.gradient(0);
          state.step();
          (void)cohort::all_reduce_values(pg, {1.0, 2.0, 3.0});  // its own: the joined rank is in the agreement
        }
      });
    } catch (const cohort::error& e) {
      errors[static_cast<std::size_t>(rank)] = e.what();
    }
  });
  // Within the timeout (5 s) and a report, every rank names both calls.
  CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(15));
  CHECK_THAT(errors[0], Catch::Contains("rank 1 is in all_reduce #5 (int64 x 3, sum)"));
  CHECK_THAT(errors[1], Catch::Contains("rank 0 is in all_reduce #5 (double x 3, sum)"));
}

TEST_CASE("llm.c's per-rank token shards of different lengths train in step under a join scope",
          "[training_state][join][gloo]") {
  // Each rank reads its own shard of tokens, batches of 64 tokens: 7, 5 and 10 batches.
  const std::vector<std::size_t> shard_tokens{500, 350, 700};
  uneven u{{}, strategy::zero2};
  for (const std::size_t tokens : shard_tokens) u.batches.push_back(static_cast<int>(tokens / 64));
  const auto expected = uneven_reference(u);
  std::vector<std::vector<double>> results(3);
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(3, [&](int rank) {
    auto pg = cohort_test::make_gloo_group(store, rank, 3);
    results[static_cast<std::size_t>(rank)] = uneven_train(u, pg);
  });
  for (const auto& result : results) CHECK(max_difference(result, expected) < 1e-9);
}
