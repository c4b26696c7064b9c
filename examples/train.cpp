// One trainer, every strategy: the data-parallel example's MLP trained through
// cohort::training_state, whose one option picks data parallelism (ddp), sharded optimizer
// state (zero1), sharded gradients too (zero2) or sharded parameters too (zero3, FSDP). The
// training loop below is the same for all four: it gathers each layer before using it (free
// where parameters stay resident), writes each layer's gradients where the state says and
// marks them ready, and steps.
//
//   train --strategy zero3 --ranks 4            # 4 ranks as threads of this process
//   mpirun -np 4 train --strategy zero2         # or torchrun --nproc-per-node 4 --no-python train
//   train --ranks 4 --checkpoint ckpt --save-every 5 --stop-after 9   # stopped after step 9
//   train --ranks 2 --strategy zero3 --checkpoint ckpt --resume       # continues at step 10
//
// The parameters sit in one flat buffer laid out as llm.c lays out GPT-2's (tensor-major,
// stacked over the hidden layers: examples/flat_model.hpp). Each rank prints what it holds
// and what a step puts on the wire; rank 0 ends with the final loss against one process
// training on the whole batch with AdamW written out in double.
#include <cohort/cohort.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
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
  std::string checkpoint;  // a directory: save there (and resume from it with `resume`)
  int save_every = 0;      // steps between checkpoints; 0: only the last step's
  bool resume = false;     // continue from the newest complete checkpoint, at any world and strategy
  int stop_after = -1;     // >= 0: stop (exit 0) after this step, as a job that was stopped
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

// One process, whole batches, the reference optimizer: what every strategy must equal.
std::vector<float> train_single(const config& cfg, const mlp& model, const flat_layout& layout,
                                const cohort_examples::synthetic_data& data) {
  auto params = initial_parameters(model, layout);
  std::vector<float> gradients(params.size());
  cohort_examples::adamw_reference optimizer(layout, params, cfg.adam, cfg.max_grad_norm);
  for (int step = 0; step < cfg.steps; ++step) {
    const std::size_t first = static_cast<std::size_t>(step) * cfg.batch;
    model.loss_and_gradients(layout.tensors(params), layout.tensors(gradients),
                             cohort_examples::rows(data.inputs, first, cfg.batch, model.input_width()),
                             cohort_examples::rows(data.targets, first, cfg.batch, model.output_width()), cfg.batch);
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

// One rank's training. The loop is the same whatever cfg.strategy says. `stopped` is set when
// --stop-after ended it early.
std::vector<float> train(bool& stopped, cohort::process_group<cohort::gloo>& pg, const config& cfg, const mlp& model,
                         const flat_layout& layout, const cohort_examples::synthetic_data& data) {
  cohort::training_state<cohort::gloo> state(
      pg, regions_of(model, layout),
      {.strategy = cfg.strategy, .bucket_bytes = 64 << 10, .adam = cfg.adam, .max_grad_norm = cfg.max_grad_norm});
  state.load_parameters(initial_parameters(model, layout));
  // The data is indexed by step: the sampler's position is the next step, kept in the
  // checkpoint's metadata with the data's seed.
  int first_step = 0;
  if (cfg.resume && !cfg.checkpoint.empty())
    if (const auto resumed = cohort::resume_checkpoint(state, cfg.checkpoint)) {
      first_step = std::stoi(resumed->metadata.at("next_step"));
      if (pg.rank() == 0)
        std::printf(
            "resumed from %s (saved at %d ranks under %s, %llu bytes read here, %.3f s): continuing at step %d\n",
            resumed->path.c_str(), resumed->world_size, resumed->strategy.c_str(),
            static_cast<unsigned long long>(resumed->bytes_read), resumed->seconds, first_step);
    }
  // Periodic saves are asynchronous (training waits for the copy into host staging only; the
  // previous one commits at the next save); the last step's is waited for.
  cohort::async_checkpointer saver(state);
  const auto report = [&](const std::optional<cohort::checkpoint_info>& saved) {
    if (saved && pg.rank() == 0)
      std::printf("saved %s (%llu bytes from rank 0, %.3f s, training blocked %.3f s)\n", saved->path.c_str(),
                  static_cast<unsigned long long>(saved->bytes_written), saved->seconds, saver.last_blocked_seconds());
  };
  const auto save = [&](int step, bool last) {
    report(saver.save(cfg.checkpoint, static_cast<std::uint64_t>(step),
                      {.metadata = {{"next_step", std::to_string(step + 1)}, {"data_seed", "2024"}}, .keep_last = 3}));
    if (last) report(saver.wait());
  };
  const std::size_t layers = model.layers(), local = cfg.batch / static_cast<std::size_t>(pg.size());
  std::vector<std::vector<float>> activation(layers + 1);
  for (int step = first_step; step < cfg.steps; ++step) {
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
    const float mean_loss = cohort::all_reduce_value(pg, loss, cohort::op::avg);
    if (pg.rank() == 0 && (step % 5 == 0 || step + 1 == cfg.steps))
      std::printf("step %2d  loss %.6f  grad norm %.4f%s\n", step, mean_loss, result.grad_norm,
                  result.clip_factor < 1 ? " (clipped)" : "");
    const bool stop = step == cfg.stop_after;
    if (!cfg.checkpoint.empty() &&
        ((cfg.save_every > 0 && (step + 1) % cfg.save_every == 0) || stop || step + 1 == cfg.steps)) {
      save(step, stop || step + 1 == cfg.steps);
    }
    if (stop) {
      stopped = true;
      break;
    }
  }
  const auto memory = state.memory();
  std::printf("[rank %d] memory per rank: parameters %s, gradients %s, optimizer state %s\n", pg.rank(),
              human(memory.parameters).c_str(), human(memory.gradients).c_str(), human(memory.optimizer_state).c_str());
  std::printf("[rank %d] wire bytes per step: %zu (%s, %zu buckets)\n", pg.rank(), state.wire_bytes_per_step(),
              human(state.wire_bytes_per_step()).c_str(), state.bucket_count());
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
    if (arg == "--checkpoint")
      cfg.checkpoint = value();
    else if (arg == "--save-every")
      cfg.save_every = std::stoi(value());
    else if (arg == "--resume")
      cfg.resume = true;
    else if (arg == "--stop-after")
      cfg.stop_after = std::stoi(value());
    else if (arg == "--ranks")
      cfg.ranks = std::stoi(value());
    else if (arg == "--steps")
      cfg.steps = std::stoi(value());
    else if (arg == "--batch")
      cfg.batch = std::stoul(value());
    else if (arg == "--strategy") {
      const std::string name = value();
      const auto parsed = cohort::parse_strategy(name);
      if (!parsed) throw std::runtime_error("--strategy " + name + ": use ddp, zero1, zero2 or zero3");
      cfg.strategy = *parsed;
    } else {
      std::printf(
          "usage: train [--strategy ddp|zero1|zero2|zero3] [--ranks N] [--steps S] [--batch B]\n"
          "             [--checkpoint DIR [--save-every K] [--resume] [--stop-after N]]\n"
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
  const auto data = cohort_examples::synthetic_data::make(cfg.batch * static_cast<std::size_t>(cfg.steps),
                                                          model.input_width(), model.output_width(), 2024);
  int status = 0;
  cohort::run_ranks(cfg.ranks, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
    if (cfg.batch % static_cast<std::size_t>(env.world_size) != 0)
      throw std::runtime_error("--batch must be divisible by the number of ranks");
    cohort::process_group<cohort::gloo> pg{store, env};
    bool stopped = false;
    const auto trained = train(stopped, pg, cfg, model, layout, data);
    if (pg.rank() != 0) return;
    // Summaries of the gathered parameters in double, so that two runs compare from outside.
    double sum = 0, squares = 0, largest = 0;
    for (const float p : trained) {
      sum += p;
      squares += static_cast<double>(p) * p;
      largest = std::max(largest, std::abs(static_cast<double>(p)));
    }
    std::printf("final parameters: sum %.9e, sum of squares %.9e, max |param| %.9e\n", sum, squares, largest);
    if (stopped) return;  // stopped as a job is: the comparison is for a finished run
    const auto single = train_single(cfg, model, layout, data);
    // The final loss of each on the last step's whole batch.
    const std::size_t last = static_cast<std::size_t>(cfg.steps - 1) * cfg.batch;
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
