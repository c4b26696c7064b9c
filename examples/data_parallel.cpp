// Data-parallel training of a small MLP on the CPU, with Gloo and cohort's gradient reducer.
//
//   data_parallel --ranks 2                 # 2 ranks as threads of this process
//   mpirun -np 2 data_parallel              # or torchrun --nproc-per-node 2 --no-python data_parallel
//
// Every rank trains on its own shard of each batch; the reducer averages the gradients in
// buckets while the backward pass is still running, so every rank takes the same SGD step a
// single process would take on the whole batch. At the end the main rank trains that single
// process too and checks that both reach the same loss.
#include <cohort/cohort.hpp>
#include <cohort/reducer.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "command_line.hpp"
#include "mlp.hpp"

namespace {

struct config {
  int ranks = 0;  // 0: read the launcher's environment
  int steps = 40;
  std::size_t batch = 48;  // global batch, split evenly over the ranks
  float lr = 0.3f;
  bool user_buffers = false;
  std::vector<std::size_t> widths{32, 192, 192, 8};
};

using tensors = std::vector<std::vector<float>>;

tensors zeros(const std::vector<std::size_t>& sizes) {
  tensors result;
  for (auto n : sizes) result.emplace_back(n, 0.0f);
  return result;
}
std::vector<std::span<float>> spans(tensors& values) { return {values.begin(), values.end()}; }

// The batch of step s is samples [s * batch, (s + 1) * batch) of the data set.
cohort_examples::synthetic_data make_data(const config& cfg, const cohort_examples::mlp& model) {
  return cohort_examples::synthetic_data::make(cfg.batch * static_cast<std::size_t>(cfg.steps), model.input_width(),
                                               model.output_width(), 2024);
}

// Loss of `params` on the whole data set, in one process.
float evaluate(const cohort_examples::mlp& model, tensors& params, const cohort_examples::synthetic_data& data) {
  auto scratch = zeros(model.parameter_sizes());
  return model.loss_and_gradients(spans(params), spans(scratch), data.inputs, data.targets, data.samples);
}

// The reference: one process, whole batches.
float train_single(const config& cfg) {
  const cohort_examples::mlp model(cfg.widths);
  const auto data = make_data(cfg, model);
  auto params = zeros(model.parameter_sizes());
  auto grads = zeros(model.parameter_sizes());
  model.initialize(spans(params), 7);
  for (int step = 0; step < cfg.steps; ++step) {
    const std::size_t first = static_cast<std::size_t>(step) * cfg.batch;
    model.loss_and_gradients(
        spans(params), spans(grads),
        std::span<const float>(data.inputs).subspan(first * model.input_width(), cfg.batch * model.input_width()),
        std::span<const float>(data.targets).subspan(first * model.output_width(), cfg.batch * model.output_width()),
        cfg.batch);
    for (std::size_t t = 0; t < params.size(); ++t)
      for (std::size_t i = 0; i < params[t].size(); ++i) params[t][i] -= cfg.lr * grads[t][i];
  }
  return evaluate(model, params, data);
}

// One rank's training. Returns the final loss on the whole data set (same on every rank).
float train(cohort::process_group<cohort::gloo>& pg, const config& cfg) {
  cohort::rank_logger log(pg);
  const cohort_examples::mlp model(cfg.widths);
  const auto data = make_data(cfg, model);
  const auto world = static_cast<std::size_t>(pg.world_size());
  const std::size_t shard = cfg.batch / world;

  auto params = zeros(model.parameter_sizes());
  model.initialize(spans(params), 7);
  cohort::broadcast_parameters(pg, spans(params), 0).wait();  // replicas start equal

  // Small caps so this small model (about 45 k parameters) spans several buckets.
  const cohort::reducer_options options{.first_bucket_bytes = 16 << 10, .bucket_bytes = 64 << 10};
  auto user_grads = zeros(model.parameter_sizes());
  auto ddp = cfg.user_buffers
                 ? std::make_unique<cohort::gradient_reducer<cohort::gloo>>(pg, spans(user_grads), options)
                 : std::make_unique<cohort::gradient_reducer<cohort::gloo>>(pg, model.parameter_sizes(), options);
  if (cohort::is_main_process(pg))
    log(model.parameter_sizes().size(), " tensors in ", ddp->bucket_count(), " buckets, ", pg.world_size(),
        " rank(s), shard ", shard, " of a batch of ", cfg.batch,
        cfg.user_buffers ? ", user buffers" : ", bucket views");

  for (int step = 0; step < cfg.steps; ++step) {
    const std::size_t first = static_cast<std::size_t>(step) * cfg.batch + static_cast<std::size_t>(pg.rank()) * shard;
    auto grads = ddp->gradients();
    float loss = model.loss_and_gradients(
        spans(params), grads,
        std::span<const float>(data.inputs).subspan(first * model.input_width(), shard * model.input_width()),
        std::span<const float>(data.targets).subspan(first * model.output_width(), shard * model.output_width()), shard,
        [&](std::size_t t) { ddp->mark_ready(t); });  // starts each bucket's all-reduce as it fills
    ddp->finish();
    // Equal shards: the batch loss is the average of the shard losses.
    pg.all_reduce(std::span<float>(&loss, 1), cohort::op::avg).wait();
    if (step % 5 == 0 || step + 1 == cfg.steps) log("step ", step, " loss ", loss);
    for (std::size_t t = 0; t < params.size(); ++t)
      for (std::size_t i = 0; i < params[t].size(); ++i) params[t][i] -= cfg.lr * grads[t][i];
  }
  return evaluate(model, params, data);
}

int report(float distributed, const config& cfg) {
  const float single = train_single(cfg);
  const float difference = std::abs(distributed - single);
  const bool match = difference <= 1e-5f;
  std::printf("final loss: data-parallel %.7f, single rank %.7f, |difference| %.2e: %s\n", distributed, single,
              difference, match ? "match" : "MISMATCH");
  return match ? 0 : 1;
}

config parse(int argc, char** argv) {
  config cfg;
  for (cohort_examples::command_line args(argc, argv); args.next();) {
    const std::string& arg = args.flag();
    if (arg == "--ranks")
      cfg.ranks = std::stoi(args.value());
    else if (arg == "--steps")
      cfg.steps = std::stoi(args.value());
    else if (arg == "--batch")
      cfg.batch = std::stoul(args.value());
    else if (arg == "--lr")
      cfg.lr = std::stof(args.value());
    else if (arg == "--user-buffers")
      cfg.user_buffers = true;
    else {
      args.usage(
          "usage: data_parallel [--ranks N] [--steps S] [--batch B] [--lr LR] [--user-buffers]\n"
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
      throw std::runtime_error("--batch must be divisible by the number of ranks");
    cohort::process_group<cohort::gloo> pg{store, env};
    const float loss = train(pg, cfg);
    if (cohort::is_main_process(pg)) status = report(loss, cfg);
  });
  return status;
} catch (const std::exception& failure) {
  std::fprintf(stderr, "data_parallel: %s\n", failure.what());
  return 1;
}
