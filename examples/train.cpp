// One trainer, every strategy: the data-parallel example's MLP trained through
// cohort::training_state, whose one option picks data parallelism (ddp), sharded optimizer
// state (zero1), sharded gradients too (zero2) or sharded parameters too (zero3, FSDP). The
// training loop below is the same for all four: it gathers each layer before using it (free
// where parameters stay resident), writes each layer's gradients where the state says and
// marks them ready, and steps.
//
//   train --strategy zero3 --ranks 4            # 4 ranks as threads of this process
//   mpirun -np 4 train --strategy zero2         # or torchrun --nproc-per-node 4 --no-python train
//   train --ranks 3 --batches-per-rank 5,3,0    # uneven inputs: a join scope keeps them in step
//
// The parameters sit in one flat buffer laid out as llm.c lays out GPT-2's (tensor-major,
// stacked over the hidden layers: examples/flat_model.hpp). Each rank prints what it holds
// and what a step puts on the wire; rank 0 ends with the final loss against one process
// training on the whole batch with AdamW written out in double.
#include <cohort/cohort.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "flat_model.hpp"
#include "mlp.hpp"

namespace {

using cohort_examples::flat_layout;
using cohort_examples::mlp;

struct config {
  int ranks = 0;  // 0: read the launcher's environment
  int steps = 20;
  std::size_t batch = 48;  // global batch per step
  cohort::strategy strategy = cohort::strategy::ddp;
  std::vector<std::size_t> widths{32, 128, 128, 128, 128, 128, 128, 8};
  cohort::adam_options adam{.lr = 2e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01};
  double max_grad_norm = 1.0;
  // Uneven inputs: rank k trains batches[k] steps inside a join scope (empty: every rank
  // trains `steps`). The reference then trains on the union of the batches of each step.
  std::vector<int> batches_per_rank;
  int batches_of(int rank) const {
    return batches_per_rank.empty() ? steps : batches_per_rank.at(static_cast<std::size_t>(rank));
  }
  int total_steps() const {
    return batches_per_rank.empty() ? steps : *std::max_element(batches_per_rank.begin(), batches_per_rank.end());
  }
};

// The model's tensors as regions of its flat buffer: W_l and b_l in layer l, matrices decayed.
std::vector<cohort::region> regions_of(const mlp& model, const flat_layout& layout) {
  std::vector<cohort::region> regions;
  for (std::size_t t = 0; t < layout.regions.size(); ++t)
    regions.push_back({(t % 2 == 0 ? "W" : "b") + std::to_string(t / 2), layout.regions[t].offset,
                       layout.regions[t].count, t / 2, layout.decay[t] != 0, 1.0});
  (void)model;
  return regions;
}

std::vector<float> initial_parameters(const mlp& model, const flat_layout& layout) {
  std::vector<float> flat(layout.elements);
  const auto tensors = layout.tensors(flat);
  model.initialize(tensors, 7);
  return flat;
}

// Mean squared error of `params` (flat, the layout's) on rows [first, first + count).
double loss_of(const mlp& model, const flat_layout& layout, std::vector<float> params,
               const cohort_examples::synthetic_data& data, std::size_t first, std::size_t count) {
  const auto tensors = layout.tensors(params);
  std::vector<float> in(cohort_examples::rows(data.inputs, first, count, model.input_width()).begin(),
                        cohort_examples::rows(data.inputs, first, count, model.input_width()).end());
  for (std::size_t l = 0; l < model.layers(); ++l) {
    std::vector<float> out(count * tensors[2 * l + 1].size());
    model.forward_layer(l, tensors[2 * l], tensors[2 * l + 1], in, out, count);
    in = std::move(out);
  }
  std::vector<float> delta(in.size());
  return model.output_loss(in, cohort_examples::rows(data.targets, first, count, model.output_width()), count, delta);
}

// One process, the reference optimizer: what every strategy must equal. Each step trains on
// the union of the rows of the ranks that still have batches (all of them, with even inputs).
std::vector<float> train_single(const config& cfg, const mlp& model, const flat_layout& layout,
                                const cohort_examples::synthetic_data& data, int world) {
  auto params = initial_parameters(model, layout);
  std::vector<float> gradients(params.size());
  cohort_examples::adamw_reference optimizer(layout, params, cfg.adam, cfg.max_grad_norm);
  const std::size_t local = cfg.batch / static_cast<std::size_t>(world);
  std::vector<float> inputs, targets;
  for (int step = 0; step < cfg.total_steps(); ++step) {
    inputs.clear();
    targets.clear();
    std::size_t rows = 0;
    for (int rank = 0; rank < world; ++rank) {
      if (cfg.batches_of(rank) <= step) continue;
      const std::size_t first = static_cast<std::size_t>(step) * cfg.batch + static_cast<std::size_t>(rank) * local;
      const auto x = cohort_examples::rows(data.inputs, first, local, model.input_width());
      const auto y = cohort_examples::rows(data.targets, first, local, model.output_width());
      inputs.insert(inputs.end(), x.begin(), x.end());
      targets.insert(targets.end(), y.begin(), y.end());
      rows += local;
    }
    model.loss_and_gradients(layout.tensors(params), layout.tensors(gradients), inputs, targets, rows);
    optimizer.step(gradients, params);
  }
  return params;
}

std::string human(std::size_t bytes) {
  char text[32];
  if (bytes >= (std::size_t{1} << 20))
    std::snprintf(text, sizeof text, "%.2f MiB", static_cast<double>(bytes) / (1 << 20));
  else
    std::snprintf(text, sizeof text, "%.1f KiB", static_cast<double>(bytes) / 1024);
  return text;
}

// One rank's training. The loop is the same whatever cfg.strategy says.
std::vector<float> train(cohort::process_group<cohort::gloo>& pg, const config& cfg, const mlp& model,
                         const flat_layout& layout, const cohort_examples::synthetic_data& data) {
  cohort::training_state<cohort::gloo> state(
      pg, regions_of(model, layout),
      {.strategy = cfg.strategy, .bucket_bytes = 64 << 10, .adam = cfg.adam, .max_grad_norm = cfg.max_grad_norm});
  state.load_parameters(initial_parameters(model, layout));
  const std::size_t layers = model.layers(), local = cfg.batch / static_cast<std::size_t>(pg.size());
  std::vector<std::vector<float>> activation(layers + 1);
  // With uneven inputs a rank out of batches waits at this scope's end, answering the others.
  std::optional<cohort::training_state<cohort::gloo>::join_scope> joined;
  if (!cfg.batches_per_rank.empty()) joined.emplace(state, cohort::training_state<cohort::gloo>::join_options{});
  const auto started = std::chrono::steady_clock::now();
  for (int step = 0; step < cfg.batches_of(pg.rank()); ++step) {
    const std::size_t first = static_cast<std::size_t>(step) * cfg.batch + static_cast<std::size_t>(pg.rank()) * local;
    const auto inputs = cohort_examples::rows(data.inputs, first, local, model.input_width());
    activation[0].assign(inputs.begin(), inputs.end());
    for (std::size_t l = 0; l < layers; ++l) {  // forward
      auto layer = state.gather(l);
      activation[l + 1].assign(local * layer.param(2 * l + 1).size(), 0.0f);
      model.forward_layer(l, layer.param(2 * l), layer.param(2 * l + 1), activation[l], activation[l + 1], local);
    }
    std::vector<float> delta(activation.back().size());
    const float loss = model.output_loss(
        activation.back(), cohort_examples::rows(data.targets, first, local, model.output_width()), local, delta);
    for (std::size_t l = layers; l-- > 0;) {  // backward, last layer first
      auto layer = state.gather(l);
      std::vector<float> previous(l > 0 ? activation[l].size() : 0);
      model.backward_layer(l, layer.param(2 * l), activation[l], delta, state.gradient(2 * l),
                           state.gradient(2 * l + 1), previous, local);
      state.mark_layer_ready(l);
      delta = std::move(previous);
    }
    const auto result = state.step();
    // Inside a join scope no collective of the trainer's own: a joined rank is waiting in the
    // state's agreement. Rank 0's own loss is printed there instead of the mean.
    const float shown = joined ? loss : cohort::all_reduce_value(pg, loss, cohort::op::avg);
    if (pg.rank() == 0 && (step % 5 == 0 || step + 1 == cfg.batches_of(0)))
      std::printf("step %2d  loss %.6f%s  grad norm %.4f%s\n", step, shown, joined ? " (rank 0's)" : "",
                  result.grad_norm, result.clip_factor < 1 ? " (clipped)" : "");
  }
  if (joined) joined->finish();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  const auto memory = state.memory();
  std::printf("[rank %d] memory per rank: parameters %s, gradients %s, optimizer state %s\n", pg.rank(),
              human(memory.parameters).c_str(), human(memory.gradients).c_str(), human(memory.optimizer_state).c_str());
  std::printf("[rank %d] wire bytes per step: %zu (%s, %zu buckets); %.2f ms per step\n", pg.rank(),
              state.wire_bytes_per_step(), human(state.wire_bytes_per_step()).c_str(), state.bucket_count(),
              1e3 * seconds / std::max(cfg.total_steps(), 1));
  std::fflush(stdout);
  return state.gather_parameters();
}

config parse(int argc, char** argv) {
  config cfg;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--ranks")
      cfg.ranks = std::stoi(value());
    else if (arg == "--steps")
      cfg.steps = std::stoi(value());
    else if (arg == "--batch")
      cfg.batch = std::stoul(value());
    else if (arg == "--batches-per-rank") {
      const std::string list = value();
      for (std::size_t at = 0; at <= list.size();) {
        const std::size_t comma = std::min(list.find(',', at), list.size());
        cfg.batches_per_rank.push_back(std::stoi(list.substr(at, comma - at)));
        at = comma + 1;
      }
    } else if (arg == "--strategy") {
      const std::string name = value();
      const auto parsed = cohort::parse_strategy(name);
      if (!parsed) throw std::runtime_error("--strategy " + name + ": use ddp, zero1, zero2 or zero3");
      cfg.strategy = *parsed;
    } else {
      std::printf(
          "usage: train [--strategy ddp|zero1|zero2|zero3] [--ranks N] [--steps S] [--batch B]\n"
          "             [--batches-per-rank B0,B1,...]\n"
          "  without --ranks, ranks come from the launcher (mpirun, torchrun, srun)\n");
      std::exit(arg == "--help" || arg == "-h" ? 0 : 2);
    }
  }
  return cfg;
}

}  // namespace

int main(int argc, char** argv) try {
  const config cfg = parse(argc, argv);
  const mlp model(cfg.widths);
  const auto layout = flat_layout::of(model);
  const auto data = cohort_examples::synthetic_data::make(cfg.batch * static_cast<std::size_t>(cfg.total_steps()),
                                                          model.input_width(), model.output_width(), 2024);
  int status = 0;
  cohort::run_ranks(cfg.ranks, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
    if (cfg.batch % static_cast<std::size_t>(env.world_size) != 0)
      throw std::runtime_error("--batch must be divisible by the number of ranks");
    if (!cfg.batches_per_rank.empty() && cfg.batches_per_rank.size() != static_cast<std::size_t>(env.world_size))
      throw std::runtime_error("--batches-per-rank names " + std::to_string(cfg.batches_per_rank.size()) +
                               " ranks for a world of " + std::to_string(env.world_size));
    cohort::process_group<cohort::gloo> pg{store, env};
    const auto trained = train(pg, cfg, model, layout, data);
    if (pg.rank() != 0) return;
    const auto single = train_single(cfg, model, layout, data, pg.size());
    // The final loss of each on the last step's whole batch.
    const std::size_t last = static_cast<std::size_t>(cfg.total_steps() - 1) * cfg.batch;
    const double distributed = loss_of(model, layout, trained, data, last, cfg.batch);
    const double reference = loss_of(model, layout, single, data, last, cfg.batch);
    double worst = 0;
    for (std::size_t i = 0; i < trained.size(); ++i)
      worst = std::max(worst, std::abs(static_cast<double>(trained[i]) - single[i]));
    const double difference = std::abs(distributed - reference);
    const bool match = difference <= 1e-5 && worst <= 1e-4;
    std::printf("final parameters: max |difference| %.2e against one process\n", worst);
    std::printf("final loss: %s %.9f, single process %.9f, |difference| %.2e: %s\n",
                std::string(cohort::to_string(cfg.strategy)).c_str(), distributed, reference, difference,
                match ? "match" : "MISMATCH");
    status = match ? 0 : 1;
  });
  return status;
} catch (const std::exception& failure) {
  std::fprintf(stderr, "train: %s\n", failure.what());
  return 1;
}
