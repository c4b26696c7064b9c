// ZeRO stage 1 or 2 over a trainer's own flat buffers: AdamW with fp32 master weights,
// per-tensor weight decay and clipping by the global gradient norm, each rank keeping 1/N of
// the optimizer state. The parameters stay resident in the trainer's buffer (laid out as
// llm.c lays out GPT-2's, examples/flat_model.hpp) and are all-gathered back after each step.
//
//   zero --ranks 2 --stage 2               # 2 ranks as threads of this process
//   mpirun -np 4 zero --stage 1            # or torchrun --nproc-per-node 4 --no-python zero
//
// Ends with a single-process AdamW (written out here, in double) on the same batches and
// `... match`.
#include <cohort/cohort.hpp>
#include <cohort/zero.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "command_line.hpp"
#include "flat_model.hpp"
#include "mlp.hpp"

namespace {

using cohort_examples::rows;

struct config {
  int ranks = 0;  // 0: read the launcher's environment
  int stage = 2;
  int steps = 30;
  std::size_t batch = 48;
  cohort::adam_options adam{.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  double max_grad_norm = 0.5;
  std::vector<std::size_t> widths{32, 96, 96, 96, 96, 8};
};

cohort_examples::synthetic_data make_data(const config& cfg, const cohort_examples::mlp& model) {
  return cohort_examples::synthetic_data::make(cfg.batch * static_cast<std::size_t>(cfg.steps), model.input_width(),
                                               model.output_width(), 2024);
}

float full_loss(const cohort_examples::mlp& model, const cohort_examples::flat_layout& layout,
                std::vector<float>& params, const cohort_examples::synthetic_data& data) {
  std::vector<float> scratch(layout.elements);
  return model.loss_and_gradients(layout.tensors(params), layout.tensors(scratch), data.inputs, data.targets,
                                  data.samples);
}

// One process, whole batches: AdamW with clipping, in double.
float train_single(const config& cfg) {
  const cohort_examples::mlp model(cfg.widths);
  const auto layout = cohort_examples::flat_layout::of(model);
  const auto data = make_data(cfg, model);
  std::vector<float> params(layout.elements), grads(layout.elements);
  model.initialize(layout.tensors(params), 7);
  cohort_examples::adamw_reference adamw(layout, params, cfg.adam, cfg.max_grad_norm);
  for (int step = 0; step < cfg.steps; ++step) {
    const std::size_t first = static_cast<std::size_t>(step) * cfg.batch;
    model.loss_and_gradients(layout.tensors(params), layout.tensors(grads),
                             rows(data.inputs, first, cfg.batch, model.input_width()),
                             rows(data.targets, first, cfg.batch, model.output_width()), cfg.batch);
    adamw.step(grads, params);
  }
  return full_loss(model, layout, params, data);
}

float train(cohort::process_group<cohort::gloo>& pg, const config& cfg) {
  const cohort_examples::mlp model(cfg.widths);
  const auto layout = cohort_examples::flat_layout::of(model);
  const auto data = make_data(cfg, model);
  const std::size_t shard = cfg.batch / static_cast<std::size_t>(pg.size());
  std::vector<float> params(layout.elements), grads(layout.elements);
  model.initialize(layout.tensors(params), 7);  // the same seed on every rank: equal replicas

  cohort::zero_optimizer<cohort::gloo, float> zero{pg,
                                                   std::span<float>(params),
                                                   std::span<float>(grads),
                                                   layout.regions,
                                                   {.stage = cfg.stage,
                                                    .bucket_bytes = 32 << 10,
                                                    .adam = cfg.adam,
                                                    .max_grad_norm = cfg.max_grad_norm,
                                                    .decay = layout.decay}};
  if (cohort::is_main_process(pg)) {
    const std::size_t full_state = 3 * layout.elements * sizeof(float);
    // The gradient shard is this rank's part of the averaged gradients, cast to fp32 once
    // per step; nothing else of the gradients is copied.
    std::printf(
        "ZeRO-%d, %d rank(s), %zu buckets: optimizer state %zu bytes per rank (%.1f%% of %zu), fp32 "
        "gradient shard %zu bytes, %zu bytes on the wire per step\n",
        cfg.stage, pg.size(), zero.bucket_count(), zero.optimizer_state_bytes(),
        100.0 * static_cast<double>(zero.optimizer_state_bytes()) / static_cast<double>(full_state), full_state,
        zero.gradient_shard_bytes(), zero.wire_bytes_per_step());
  }
  for (int step = 0; step < cfg.steps; ++step) {
    const std::size_t first = static_cast<std::size_t>(step) * cfg.batch + static_cast<std::size_t>(pg.rank()) * shard;
    float loss = model.loss_and_gradients(
        layout.tensors(params), layout.tensors(grads), rows(data.inputs, first, shard, model.input_width()),
        rows(data.targets, first, shard, model.output_width()), shard, [&](std::size_t t) { zero.mark_ready(t); });
    const auto result = zero.step();
    zero.parameters_ready().wait();  // before the next forward reads them
    pg.all_reduce(std::span<float>(&loss, 1), cohort::op::avg).wait();
    if (cohort::is_main_process(pg) && (step % 10 == 0 || step + 1 == cfg.steps))
      std::printf("step %d loss %.6f grad norm %.4f%s\n", step, loss, result.grad_norm,
                  result.clip_factor < 1 ? " (clipped)" : "");
  }
  return full_loss(model, layout, params, data);
}

config parse(int argc, char** argv) {
  config cfg;
  for (cohort_examples::command_line args(argc, argv); args.next();) {
    const std::string& arg = args.flag();
    if (arg == "--ranks") {
      cfg.ranks = std::stoi(args.value());
    } else if (arg == "--stage") {
      cfg.stage = std::stoi(args.value());
    } else if (arg == "--steps") {
      cfg.steps = std::stoi(args.value());
    } else {
      args.usage(
          "usage: zero [--ranks N] [--stage 1|2] [--steps S]\n"
          "  without --ranks, ranks come from the launcher (mpirun, torchrun, srun)\n");
    }
  }
  return cfg;
}

}  // namespace

int main(int argc, char** argv) try {
  const config cfg = parse(argc, argv);
  int status = 0;
  cohort::run_ranks(cfg.ranks, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
    if (cfg.batch % static_cast<std::size_t>(env.world_size) != 0)
      throw std::runtime_error("the batch of " + std::to_string(cfg.batch) + " does not split over " +
                               std::to_string(env.world_size) + " ranks");
    cohort::process_group<cohort::gloo> pg{store, env};
    const float loss = train(pg, cfg);
    if (!cohort::is_main_process(pg)) return;
    const float single = train_single(cfg);
    const float difference = std::abs(loss - single);
    const bool match = difference <= 1e-5f * std::max(1.0f, single);
    std::printf("final loss: ZeRO-%d %.7f, single-rank AdamW %.7f, |difference| %.2e: %s\n", cfg.stage, loss, single,
                difference, match ? "match" : "MISMATCH");
    status = match ? 0 : 1;
  });
  return status;
} catch (const std::exception& failure) {
  std::fprintf(stderr, "zero: %s\n", failure.what());
  return 1;
}
