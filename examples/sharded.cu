// Sharded parameters on GPUs with NCCL: the CUDA twin of sharded.cpp. Shards, gathered
// weights, gradients and Adam state live in device memory; gathers are ordered with the
// caller's stream through events, and the Adam update runs as kernels on the shard.
// The MLP's forward and backward are the shared host code (examples/mlp.hpp), so each
// gathered layer is copied to the host and its gradient back: what this shows is the
// sharding machinery, not a fast model.
//
//   sharded_cuda                                                  # one GPU
//   torchrun --nproc-per-node 2 --no-python sharded_cuda          # or mpirun -np 2
//
// Ends, on rank 0, with the final parameters against one process training on the whole
// batch with Adam written out on the host (the line ends with "match").
#include <cohort/backend/nccl.hpp>
#include <cohort/guards.hpp>
#include <cohort/launch.hpp>
#include <cohort/optim.hpp>
#include <cohort/sharded.hpp>
#include <cohort/store.hpp>
#include <cohort/tcp_store.hpp>

#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlp.hpp"

namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

}  // namespace

int main() try {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("sharded_cuda: no CUDA device; nothing to do\n");
    return 0;
  }
  const auto env = cohort::launch_env::detect();
  auto store = env.world_size == 1 ? std::shared_ptr<cohort::store>(std::make_shared<cohort::memory_store>())
                                   : cohort::connect_store(env);
  cohort::process_group<cohort::nccl> pg{store, env};
  cohort::rank_logger log(pg);

  const std::size_t batch = 48, steps = 12;
  if (batch % static_cast<std::size_t>(pg.world_size()) != 0) throw std::runtime_error("the world size must divide 48");
  const cohort_examples::mlp model({32, 192, 192, 8});
  const auto data =
      cohort_examples::synthetic_data::make(batch * steps, model.input_width(), model.output_width(), 2024);
  const auto sizes = model.parameter_sizes();
  std::vector<std::vector<std::size_t>> units;
  for (std::size_t l = 0; l < model.layers(); ++l) units.push_back({sizes[2 * l], sizes[2 * l + 1]});

  cudaStream_t stream;
  check(cudaStreamCreate(&stream), "cudaStreamCreate");
  cohort::sharded_parameters<cohort::nccl, float> params(pg, units, {.prefetch = 1});
  params.set_stream(stream);
  std::vector<std::vector<float>> initial;
  if (pg.rank() == 0) {
    for (auto n : sizes) initial.emplace_back(n);
    model.initialize(std::vector<std::span<float>>(initial.begin(), initial.end()), 7);
  }
  params.scatter_from(0, initial);  // host memory on rank 0; each rank receives its shard
  cohort::adam opt(params, {.lr = 1e-3});

  std::vector<std::vector<float>> host_params, host_grads;
  for (auto n : sizes) {
    host_params.emplace_back(n);
    host_grads.emplace_back(n);
  }
  std::vector<float*> device_grads;
  for (auto n : sizes) {
    float* g = nullptr;
    check(cudaMalloc(&g, n * sizeof(float)), "cudaMalloc");
    device_grads.push_back(g);
  }
  const std::size_t local = batch / static_cast<std::size_t>(pg.world_size());
  for (std::size_t step = 0; step < steps; ++step) {
    params.set_order(cohort::prefetch_order::forward);
    for (std::size_t l = 0; l < model.layers(); ++l) {
      auto layer = params.gather(l);  // released at the end of this scope, as soon as copied
      for (std::size_t p = 0; p < 2; ++p) {
        auto w = layer.param(p);
        check(cudaMemcpyAsync(host_params[2 * l + p].data(), w.data(), w.size() * sizeof(float), cudaMemcpyDeviceToHost,
                              stream),
              "download");
      }
    }
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    const std::size_t first = step * batch + static_cast<std::size_t>(pg.rank()) * local;
    float loss =
        model.loss_and_gradients(std::vector<std::span<float>>(host_params.begin(), host_params.end()),
                                 std::vector<std::span<float>>(host_grads.begin(), host_grads.end()),
                                 std::span<const float>(data.inputs).subspan(first * model.input_width()),
                                 std::span<const float>(data.targets).subspan(first * model.output_width()), local);
    for (std::size_t l = model.layers(); l-- > 0;) {
      for (std::size_t p = 0; p < 2; ++p)
        check(cudaMemcpyAsync(device_grads[2 * l + p], host_grads[2 * l + p].data(), sizes[2 * l + p] * sizeof(float),
                              cudaMemcpyHostToDevice, stream),
              "upload");
      const std::vector<std::span<const float>> unit{{device_grads[2 * l], sizes[2 * l]},
                                                     {device_grads[2 * l + 1], sizes[2 * l + 1]}};
      params.reduce_scatter_grad(l, unit).make_stream_wait(stream);  // before the buffers are rewritten
    }
    opt.step().wait();
    if (pg.rank() == 0 && (step % 4 == 0 || step + 1 == steps)) log("step ", step, " loss (rank 0's shard) ", loss);
  }
  std::size_t parameter_bytes = 0;
  for (auto n : sizes) parameter_bytes += n * sizeof(float);
  const auto peak = params.peak_memory();
  log("peak device bytes ", params.peak_total(), " (shards ", peak.shards, ", gradients ", peak.gradients,
      ", gathered ", peak.gathered, ", pool ", peak.pool, ", optimizer ", peak.optimizer, ") against ",
      4 * parameter_bytes, " unsharded (parameters, gradients, Adam moments)");
  const auto distributed = params.gather_full_state(0);  // collective; the full model on rank 0
  for (auto g : device_grads) cudaFree(g);
  cudaStreamDestroy(stream);
  int status = 0;
  if (pg.rank() == 0) {
    const auto single = cohort_examples::train_adam_single(model, data, batch, static_cast<int>(steps), 1e-3);
    const double worst = cohort_examples::max_difference(distributed, single);
    const bool match = worst <= 1e-5;
    std::printf("final parameters: sharded on %d GPU(s) vs one process on the host, max |difference| %.2e: %s\n",
                pg.world_size(), worst, match ? "match" : "MISMATCH");
    status = match ? 0 : 1;
  }
  pg.barrier().wait();  // the others wait for the reference: rank 0 hosts the store
  return status;
} catch (const std::exception& failure) {
  std::fprintf(stderr, "sharded_cuda: %s\n", failure.what());
  return 1;
}
