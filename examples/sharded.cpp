// Training the data-parallel example's MLP with sharded parameters (ZeRO-3 / FSDP) on the
// CPU with Gloo: each rank keeps 1/N of every layer, gathers a layer's weights only while
// it is used, reduce-scatters its gradient, and runs Adam on its shard only.
//
//   sharded --ranks 4                       # 4 ranks as threads of this process
//   mpirun -np 4 sharded                    # or torchrun --nproc-per-node 4 --no-python sharded
//
// Prints each rank's peak memory against the unsharded footprint (full parameters, full
// gradients and full Adam state), and checks the result against one process training on
// the whole batch.
#include <cohort/cohort.hpp>
#include <cohort/optim.hpp>
#include <cohort/sharded.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "command_line.hpp"
#include "mlp.hpp"

namespace {

struct config {
  int ranks = 0;  // 0: read the launcher's environment
  int steps = 12;
  std::size_t batch = 48;
  double lr = 1e-3;
  int prefetch = 1;
  std::vector<std::size_t> widths{32, 192, 192, 8};
};

using tensors = std::vector<std::vector<float>>;

tensors zeros(const std::vector<std::size_t>& sizes) {
  tensors out;
  for (auto n : sizes) out.emplace_back(n, 0.0f);
  return out;
}

cohort_examples::synthetic_data make_data(const config& cfg, const cohort_examples::mlp& model) {
  return cohort_examples::synthetic_data::make(cfg.batch * static_cast<std::size_t>(cfg.steps), model.input_width(),
                                               model.output_width(), 2024);
}

// One rank's training; returns every parameter in full on rank 0 (empty elsewhere).
tensors train(cohort::process_group<cohort::gloo>& pg, const config& cfg) {
  cohort::rank_logger log(pg);
  const cohort_examples::mlp model(cfg.widths);
  const auto data = make_data(cfg, model);
  const std::size_t layers = model.layers();
  const auto sizes = model.parameter_sizes();
  std::vector<std::vector<std::size_t>> units;
  for (std::size_t l = 0; l < layers; ++l) units.push_back({sizes[2 * l], sizes[2 * l + 1]});

  cohort::sharded_parameters<cohort::gloo, float> params(pg, units, {.prefetch = cfg.prefetch});
  // Only rank 0 builds the full model; every rank receives its shards.
  tensors initial;
  if (pg.rank() == 0) {
    initial = zeros(sizes);
    model.initialize(std::vector<std::span<float>>(initial.begin(), initial.end()), 7);
  }
  params.scatter_from(0, initial);
  initial.clear();
  cohort::adam opt(params, {.lr = cfg.lr});

  const std::size_t local = cfg.batch / static_cast<std::size_t>(pg.world_size());
  using guard = cohort::sharded_parameters<cohort::gloo, float>::gathered;
  for (int step = 0; step < cfg.steps; ++step) {
    const std::size_t first = static_cast<std::size_t>(step) * cfg.batch + static_cast<std::size_t>(pg.rank()) * local;
    // Forward: each layer's full weights exist only inside its scope (prefetching the next).
    params.set_order(cohort::prefetch_order::forward);
    std::vector<std::vector<float>> activation(layers + 1);
    const auto inputs =
        std::span<const float>(data.inputs).subspan(first * model.input_width(), local * model.input_width());
    activation[0].assign(inputs.begin(), inputs.end());
    for (std::size_t l = 0; l < layers; ++l) {
      guard layer = params.gather(l);
      activation[l + 1].assign(local * cfg.widths[l + 1], 0.0f);
      model.forward_layer(l, layer.param(0), layer.param(1), activation[l], activation[l + 1], local);
    }  // released: the buffer goes back to the pool for the next gather
    std::vector<float> delta(local * model.output_width());
    float loss = model.output_loss(
        activation.back(), std::span<const float>(data.targets).subspan(first * model.output_width()), local, delta);
    // Backward: gather each layer again (FSDP's second all-gather), back to front; its
    // gradient is reduce-scattered at once and only this rank's shard of it is kept.
    params.set_order(cohort::prefetch_order::backward);
    std::vector<std::pair<cohort::gloo::work, std::vector<float>>> in_flight;  // at most two layers' gradients
    for (std::size_t l = layers; l-- > 0;) {
      guard layer = params.gather(l);
      std::vector<float> gradient(sizes[2 * l] + sizes[2 * l + 1]);
      std::vector<float> previous(l > 0 ? local * cfg.widths[l] : 0);
      auto gw = std::span<float>(gradient).first(sizes[2 * l]);
      auto gb = std::span<float>(gradient).subspan(sizes[2 * l]);
      model.backward_layer(l, layer.param(0), activation[l], delta, gw, gb, previous, local);
      layer.reset();  // released before the next layer is gathered
      in_flight.emplace_back(params.reduce_scatter_grad(l, std::span<const float>(gradient)), std::move(gradient));
      if (in_flight.size() > 2) {
        in_flight.front().first.wait();
        in_flight.erase(in_flight.begin());
      }
      delta = std::move(previous);
    }
    for (auto& [work, gradient] : in_flight) work.wait();
    opt.step();
    pg.all_reduce(std::span<float>(&loss, 1), cohort::op::avg).wait();
    if (cohort::is_main_process(pg) && (step % 4 == 0 || step + 1 == cfg.steps)) log("step ", step, " loss ", loss);
  }

  const auto peak = params.peak_memory();
  std::size_t parameter_bytes = 0;
  for (auto n : sizes) parameter_bytes += n * sizeof(float);
  const std::size_t unsharded = 4 * parameter_bytes;  // parameters, gradients, Adam's two moments
  log("peak ", params.peak_total(), " bytes (shards ", peak.shards, ", gradients ", peak.gradients, ", gathered ",
      peak.gathered, ", pool ", peak.pool, ", optimizer ", peak.optimizer, ") against ", unsharded,
      " bytes unsharded (",
      static_cast<int>(100.0 * static_cast<double>(params.peak_total()) / static_cast<double>(unsharded)), "%)");
  return params.gather_full_state(0);
}

int report(const tensors& distributed, const config& cfg) {
  const cohort_examples::mlp model(cfg.widths);
  const tensors single = cohort_examples::train_adam_single(model, make_data(cfg, model), cfg.batch, cfg.steps, cfg.lr);
  const double worst = cohort_examples::max_difference(distributed, single);
  const bool match = worst <= 1e-5;
  std::printf("final parameters: sharded vs single rank, max |difference| %.2e: %s\n", worst,
              match ? "match" : "MISMATCH");
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
    else if (arg == "--prefetch")
      cfg.prefetch = std::stoi(args.value());
    else {
      args.usage(
          "usage: sharded [--ranks N] [--steps S] [--batch B] [--prefetch D]\n"
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
    const auto full = train(pg, cfg);
    if (cohort::is_main_process(pg)) status = report(full, cfg);
  });
  return status;
} catch (const std::exception& failure) {
  std::fprintf(stderr, "sharded: %s\n", failure.what());
  return 1;
}
