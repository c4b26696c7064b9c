// train.cpp's CUDA twin: the same trainer on GPUs with NCCL, every strategy by one option.
// Parameters, gradients, optimizer state and activations live in device memory; the MLP's
// forward and backward are the examples' kernels (mlp_kernels.cuh) on one stream, which the
// state's collectives wait for and which waits for the state's gathers and step.
//
//   train_cuda --strategy zero3                                   # one GPU
//   torchrun --nproc-per-node 8 --no-python train_cuda --strategy zero2
//
// Rank 0 ends with the final loss against one process training on the host with AdamW
// written out in double. The kernels sum in another order than the host code, so the match
// allows 1e-4 on the loss (1e-2 on any parameter) where train.cpp allows 1e-5.
#include <cohort/comm/nccl.hpp>
#include <cohort/parallel/training_state.hpp>
#include <cohort/rendezvous/launch.hpp>
#include <cohort/rendezvous/store.hpp>
#include <cohort/rendezvous/tcp_store.hpp>
#include <cohort/run/atomic_write.hpp>
#include <cohort/run/guards.hpp>
#include <cohort/run/logging.hpp>
#include <cohort/run/run_ranks.hpp>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <vector>

#include "mlp_kernels.cuh"
#include "train_common.hpp"

namespace {

using cohort_examples::blocks;
using cohort_examples::check;
using cohort_examples::config;
using cohort_examples::device_tensor;
using cohort_examples::flat_layout;
using cohort_examples::mlp;

std::vector<float> train(cohort::process_group<cohort::nccl>& pg, const config& cfg, const mlp& model,
                         const flat_layout& layout, const cohort_examples::synthetic_data& data, cudaStream_t stream) {
  cohort::training_state<cohort::nccl> state(
      pg, cohort_examples::regions_of(model, layout),
      {.strategy = cfg.strategy, .bucket_bytes = 64 << 10, .adam = cfg.adam, .max_grad_norm = cfg.max_grad_norm});
  state.set_stream(stream);
  state.load_parameters(cohort_examples::initial_parameters(model, layout));
  const std::size_t layers = model.layers(), local = cfg.batch / static_cast<std::size_t>(pg.world_size());
  const auto widths = cfg.widths;
  device_tensor inputs(data.inputs.size()), targets(data.targets.size());
  check(cudaMemcpy(inputs.data, data.inputs.data(), data.inputs.size() * sizeof(float), cudaMemcpyHostToDevice),
        "upload inputs");
  check(cudaMemcpy(targets.data, data.targets.data(), data.targets.size() * sizeof(float), cudaMemcpyHostToDevice),
        "upload targets");
  check(cudaDeviceSynchronize(), "synchronize(upload)");
  std::vector<device_tensor> activation;
  for (std::size_t l = 1; l <= layers; ++l) activation.emplace_back(local * widths[l]);
  const std::size_t widest = *std::max_element(widths.begin(), widths.end());
  device_tensor delta(local * widest), previous(local * widest);  // a layer's delta, then the one below
  for (int step = 0; step < cfg.steps; ++step) {
    const std::size_t first = static_cast<std::size_t>(step) * cfg.batch + static_cast<std::size_t>(pg.rank()) * local;
    const float* in = inputs.data + first * widths.front();
    for (std::size_t l = 0; l < layers; ++l) {  // forward
      auto layer = state.gather(l);
      const int n_in = static_cast<int>(widths[l]), n_out = static_cast<int>(widths[l + 1]);
      cohort_examples::forward_layer<<<blocks(local * widths[l + 1]), 256, 0, stream>>>(
          layer.param(2 * l).data(), layer.param(2 * l + 1).data(), l == 0 ? in : activation[l - 1].data,
          activation[l].data, static_cast<int>(local), n_in, n_out, l + 1 < layers);
    }
    const std::size_t outputs = local * widths.back();
    cohort_examples::output_delta<<<blocks(outputs), 256, 0, stream>>>(
        activation.back().data, targets.data + first * widths.back(), delta.data, static_cast<int>(outputs));
    for (std::size_t l = layers; l-- > 0;) {  // backward, last layer first
      auto layer = state.gather(l);
      const int n_in = static_cast<int>(widths[l]), n_out = static_cast<int>(widths[l + 1]);
      const float* a = l == 0 ? in : activation[l - 1].data;
      cohort_examples::weight_gradient<<<blocks(widths[l] * widths[l + 1]), 256, 0, stream>>>(
          delta.data, a, state.gradient(2 * l).data(), static_cast<int>(local), n_in, n_out);
      cohort_examples::bias_gradient<<<blocks(widths[l + 1]), 256, 0, stream>>>(
          delta.data, state.gradient(2 * l + 1).data(), static_cast<int>(local), n_out);
      if (l > 0) {
        cohort_examples::previous_delta<<<blocks(local * widths[l]), 256, 0, stream>>>(
            delta.data, layer.param(2 * l).data(), a, previous.data, static_cast<int>(local), n_in, n_out);
        check(cudaMemcpyAsync(delta.data, previous.data, local * widths[l] * sizeof(float), cudaMemcpyDeviceToDevice,
                              stream),
              "delta");
      }
      check(cudaGetLastError(), "kernel launch");
      state.mark_layer_ready(l);
    }
    const auto result = state.step();
    if (pg.rank() == 0 && (step % 5 == 0 || step + 1 == cfg.steps))
      std::printf("step %2d  grad norm %.4f%s\n", step, result.grad_norm, result.clip_factor < 1 ? " (clipped)" : "");
  }
  check(cudaStreamSynchronize(stream), "synchronize");
  const auto memory = state.memory();
  std::printf("[rank %d] memory per rank: parameters %s, gradients %s, optimizer state %s\n", pg.rank(),
              cohort_examples::human(memory.parameters).c_str(), cohort_examples::human(memory.gradients).c_str(),
              cohort_examples::human(memory.optimizer_state).c_str());
  std::printf("[rank %d] wire bytes per step: %zu (%s, %zu buckets)\n", pg.rank(), state.wire_bytes_per_step(),
              cohort_examples::human(state.wire_bytes_per_step()).c_str(), state.bucket_count());
  std::fflush(stdout);
  return state.gather_parameters();
}

}  // namespace

int main(int argc, char** argv) try {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("train_cuda: no CUDA device; nothing to do\n");
    return 0;
  }
  const config cfg = cohort_examples::parse_train_options(argc, argv);
  if (!cfg.batches_per_rank.empty()) throw std::runtime_error("--batches-per-rank: use train (the CPU twin)");
  if (cfg.slow_ms > 0 || cfg.compare_one_rank)
    throw std::runtime_error("--slow-rank, --slow-ms and --compare-one-rank: use train (the CPU twin)");
  if (cfg.reproducible || cfg.nodes > 1)
    throw std::runtime_error("--reproducible, --micro-batches and --nodes: use train (the CPU twin)");
  const mlp model(cfg.widths);
  const auto layout = flat_layout::of(model);
  const auto data = cohort_examples::synthetic_data::make(cfg.batch * static_cast<std::size_t>(cfg.steps),
                                                          model.input_width(), model.output_width(), 2024);
  int status = 0;
  const auto rank_main = [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
    cohort::process_group<cohort::nccl> pg{store, env};
    if (cfg.batch % static_cast<std::size_t>(pg.world_size()) != 0)
      throw std::runtime_error("--batch must be divisible by the number of ranks");
    cudaStream_t stream;
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    const auto trained = train(pg, cfg, model, layout, data, stream);
    cudaStreamDestroy(stream);
    if (pg.rank() == 0)
      status = cohort_examples::report_against_single_process(cfg, model, layout, data, pg.world_size(), trained, 1e-4);
  };
  // One GPU: no store to serve. Launched ranks go through run_ranks, whose end every rank
  // agrees on: when any rank fails, every rank exits non-zero.
  if (const auto env = cohort::launch_env::detect(); env.world_size == 1)
    rank_main(std::make_shared<cohort::memory_store>(), env);
  else
    cohort::run_ranks(0, rank_main);
  return status;
} catch (const std::exception& failure) {
  std::fprintf(stderr, "train_cuda: %s\n", failure.what());
  return 1;
}
