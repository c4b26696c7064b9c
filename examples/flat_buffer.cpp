// Data parallelism over a trainer's own flat gradient buffer: zero copies, no second copy of
// the gradients. The parameters and gradients live in two flat buffers laid out as llm.c
// lays out GPT-2's (examples/flat_model.hpp); the reducer averages the gradients where the
// backward wrote them, in buckets that start while the backward still runs.
//
//   flat_buffer --ranks 2                  # 2 ranks as threads of this process
//   mpirun -np 2 flat_buffer               # or torchrun --nproc-per-node 2 --no-python flat_buffer
//
// Ends with the single-process training of the same batches and `... match`.
#include <cohort/cohort.hpp>
#include <cohort/reducer.hpp>

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
  int steps = 30;
  std::size_t batch = 48;  // global batch, split evenly over the ranks
  float lr = 0.3f;
  std::vector<std::size_t> widths{32, 96, 96, 96, 96, 8};
};

cohort_examples::synthetic_data make_data(const config& cfg, const cohort_examples::mlp& model) {
  return cohort_examples::synthetic_data::make(cfg.batch * static_cast<std::size_t>(cfg.steps), model.input_width(),
                                               model.output_width(), 2024);
}

// One process, whole batches, the same flat layout: the reference.
float train_single(const config& cfg) {
  const cohort_examples::mlp model(cfg.widths);
  const auto layout = cohort_examples::flat_layout::of(model);
  const auto data = make_data(cfg, model);
  std::vector<float> params(layout.elements), grads(layout.elements);
  model.initialize(layout.tensors(params), 7);
  for (int step = 0; step < cfg.steps; ++step) {
    const std::size_t first = static_cast<std::size_t>(step) * cfg.batch;
    model.loss_and_gradients(layout.tensors(params), layout.tensors(grads),
                             rows(data.inputs, first, cfg.batch, model.input_width()),
                             rows(data.targets, first, cfg.batch, model.output_width()), cfg.batch);
    for (std::size_t e = 0; e < params.size(); ++e) params[e] -= cfg.lr * grads[e];
  }
  return model.loss_and_gradients(layout.tensors(params), layout.tensors(grads), data.inputs, data.targets,
                                  data.samples);
}

float train(cohort::process_group<cohort::gloo>& pg, const config& cfg) {
  const cohort_examples::mlp model(cfg.widths);
  const auto layout = cohort_examples::flat_layout::of(model);
  const auto data = make_data(cfg, model);
  const std::size_t shard = cfg.batch / static_cast<std::size_t>(pg.world_size());
  std::vector<float> params(layout.elements), grads(layout.elements);
  model.initialize(layout.tensors(params), 7);
  const std::vector<std::span<float>> whole{params};
  cohort::broadcast_parameters(pg, std::span<const std::span<float>>(whole), 0).wait();  // replicas start equal

  // The reducer reduces the regions of `grads` where they are (in_place); small caps so this
  // model (about 40 k parameters) spans several buckets.
  cohort::gradient_reducer<cohort::gloo> ddp{
      pg,
      cohort::flat_gradients(std::span<float>(grads), layout.regions),
      {.first_bucket_bytes = 16 << 10, .bucket_bytes = 48 << 10, .in_place = true}};
  if (cohort::is_main_process(pg))
    std::printf(
        "%zu tensors in %zu buckets (%zu collectives per step), %d rank(s), shard %zu of %zu: "
        "gradient bytes copied per step %zu, extra gradient memory %zu bytes\n",
        layout.regions.size(), ddp.bucket_count(), ddp.run_count(), pg.world_size(), shard, cfg.batch,
        ddp.copied_bytes_per_step(), ddp.bucket_memory_bytes());

  for (int step = 0; step < cfg.steps; ++step) {
    const std::size_t first = static_cast<std::size_t>(step) * cfg.batch + static_cast<std::size_t>(pg.rank()) * shard;
    float loss = model.loss_and_gradients(
        layout.tensors(params), layout.tensors(grads), rows(data.inputs, first, shard, model.input_width()),
        rows(data.targets, first, shard, model.output_width()), shard, [&](std::size_t t) { ddp.mark_ready(t); });
    ddp.finish();
    pg.all_reduce(std::span<float>(&loss, 1), cohort::op::avg).wait();
    if (cohort::is_main_process(pg) && (step % 10 == 0 || step + 1 == cfg.steps))
      std::printf("step %d loss %.6f\n", step, loss);
    for (std::size_t e = 0; e < params.size(); ++e) params[e] -= cfg.lr * grads[e];
  }
  return model.loss_and_gradients(layout.tensors(params), layout.tensors(grads), data.inputs, data.targets,
                                  data.samples);
}

config parse(int argc, char** argv) {
  config cfg;
  for (cohort_examples::command_line args(argc, argv); args.next();) {
    const std::string& arg = args.flag();
    if (arg == "--ranks") {
      cfg.ranks = std::stoi(args.value());
    } else if (arg == "--steps") {
      cfg.steps = std::stoi(args.value());
    } else {
      args.usage(
          "usage: flat_buffer [--ranks N] [--steps S]\n"
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
    const bool match = difference <= 1e-5f;
    std::printf("final loss: flat-buffer data-parallel %.7f, single rank %.7f, |difference| %.2e: %s\n", loss, single,
                difference, match ? "match" : "MISMATCH");
    status = match ? 0 : 1;
  });
  return status;
} catch (const std::exception& failure) {
  std::fprintf(stderr, "flat_buffer: %s\n", failure.what());
  return 1;
}
