// The CUDA twin of flat_buffer.cpp and zero.cpp: the MLP's parameters and gradients in two
// flat device buffers laid out as llm.c lays out GPT-2's (flat_model.hpp), the forward and
// backward as kernels on a caller stream, and one of
//   --zero 0   data parallelism, the gradients reduced in place (no copies), SGD;
//   --zero 1   ZeRO-1, AdamW with clipping on 1/N of the state, parameters all-gathered back;
//   --zero 2   ZeRO-2, the same with buckets reduce-scattered during the backward.
//
//   zero_cuda --zero 2                                   # one GPU
//   torchrun --nproc-per-node 4 --no-python zero_cuda --zero 1        # or mpirun -np 4
//
// The main rank then trains one process on the whole batch with the same kernels and the
// update written out on the host in double, and checks that both end equal (`... match`).
#include <cohort/backend/nccl.hpp>
#include <cohort/guards.hpp>
#include <cohort/launch.hpp>
#include <cohort/reducer.hpp>
#include <cohort/store.hpp>
#include <cohort/tcp_store.hpp>
#include <cohort/zero.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "flat_model.hpp"
#include "mlp.hpp"
#include "mlp_kernels.cuh"

namespace {

using namespace cohort_examples;

struct config {
  int zero = 2;
  int steps = 12;
  int batch = 48;
  float sgd_lr = 0.1f;
  cohort::adam_options adam{.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  double max_grad_norm = 0.5;
  std::vector<std::size_t> widths{32, 96, 96, 96, 8};
};

// Forward and backward over flat device buffers; on_ready(t) once tensor t's gradient
// kernel is queued, last layer first. Returns the batch's loss (a host read).
float forward_backward(const config& cfg, const flat_layout& layout, float* params, float* grads, const float* x,
                       const float* y, int batch, const std::function<void(std::size_t)>& on_ready,
                       cudaStream_t stream) {
  const auto& widths = cfg.widths;
  const std::size_t layers = widths.size() - 1;
  const auto at = [&](float* base, std::size_t t) { return base + layout.regions[t].offset; };
  std::vector<device_tensor> activation;
  activation.emplace_back(static_cast<std::size_t>(batch) * widths[0]);
  check(cudaMemcpyAsync(activation[0].data, x, activation[0].count * sizeof(float), cudaMemcpyDeviceToDevice, stream),
        "copy");
  for (std::size_t l = 0; l < layers; ++l) {
    const int in = static_cast<int>(widths[l]), out = static_cast<int>(widths[l + 1]);
    activation.emplace_back(static_cast<std::size_t>(batch) * out);
    forward_layer<<<blocks(activation.back().count), 256, 0, stream>>>(at(params, 2 * l), at(params, 2 * l + 1),
                                                                       activation[l].data, activation.back().data,
                                                                       batch, in, out, l + 1 < layers);
  }
  const std::size_t outputs = activation.back().count;
  device_tensor delta(outputs);
  output_delta<<<blocks(outputs), 256, 0, stream>>>(activation.back().data, y, delta.data, static_cast<int>(outputs));
  std::vector<float> prediction(outputs), target(outputs);
  check(cudaMemcpyAsync(prediction.data(), activation.back().data, outputs * sizeof(float), cudaMemcpyDeviceToHost,
                        stream),
        "download");
  check(cudaMemcpyAsync(target.data(), y, outputs * sizeof(float), cudaMemcpyDeviceToHost, stream), "download");
  for (std::size_t l = layers; l-- > 0;) {
    const int in = static_cast<int>(widths[l]), out = static_cast<int>(widths[l + 1]);
    bias_gradient<<<blocks(out), 256, 0, stream>>>(delta.data, at(grads, 2 * l + 1), batch, out);
    if (on_ready) on_ready(2 * l + 1);
    weight_gradient<<<blocks(layout.regions[2 * l].count), 256, 0, stream>>>(delta.data, activation[l].data,
                                                                             at(grads, 2 * l), batch, in, out);
    if (on_ready) on_ready(2 * l);
    if (l == 0) break;
    device_tensor previous(static_cast<std::size_t>(batch) * in);
    previous_delta<<<blocks(previous.count), 256, 0, stream>>>(delta.data, at(params, 2 * l), activation[l].data,
                                                               previous.data, batch, in, out);
    delta = std::move(previous);
  }
  check(cudaGetLastError(), "kernel launch");
  check(cudaStreamSynchronize(stream), "loss");
  double loss = 0;
  for (std::size_t k = 0; k < outputs; ++k)
    loss += (prediction[k] - target[k]) * static_cast<double>(prediction[k] - target[k]);
  return static_cast<float>(loss / static_cast<double>(outputs));
}

struct batches {
  device_tensor inputs, targets;
  explicit batches(const config& cfg)
      : inputs(static_cast<std::size_t>(cfg.batch * cfg.steps) * cfg.widths.front()),
        targets(static_cast<std::size_t>(cfg.batch * cfg.steps) * cfg.widths.back()) {
    const auto data = synthetic_data::make(static_cast<std::size_t>(cfg.batch * cfg.steps), cfg.widths.front(),
                                           cfg.widths.back(), 2024);
    check(cudaMemcpy(inputs.data, data.inputs.data(), data.inputs.size() * sizeof(float), cudaMemcpyHostToDevice),
          "upload");
    check(cudaMemcpy(targets.data, data.targets.data(), data.targets.size() * sizeof(float), cudaMemcpyHostToDevice),
          "upload");
  }
  const float* x(const config& cfg, std::size_t first) const { return inputs.data + first * cfg.widths.front(); }
  const float* y(const config& cfg, std::size_t first) const { return targets.data + first * cfg.widths.back(); }
};

std::vector<float> initial_parameters(const config& cfg, const flat_layout& layout) {
  std::vector<float> host(layout.elements);
  mlp(cfg.widths).initialize(layout.tensors(host), 7);
  return host;
}

// One process, whole batches, the gradients downloaded and the update made on the host in
// double: SGD, or AdamW with clipping and per-tensor decay.
std::vector<float> train_single(const config& cfg, const flat_layout& layout, cudaStream_t stream) {
  const batches data(cfg);
  std::vector<float> host = initial_parameters(cfg, layout), gradient(layout.elements);
  device_tensor params(layout.elements), grads(layout.elements);
  adamw_reference adamw(layout, host, cfg.adam, cfg.max_grad_norm);
  for (int step = 0; step < cfg.steps; ++step) {
    check(cudaMemcpy(params.data, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice), "upload");
    const std::size_t first = static_cast<std::size_t>(step * cfg.batch);
    forward_backward(cfg, layout, params.data, grads.data, data.x(cfg, first), data.y(cfg, first), cfg.batch, {},
                     stream);
    check(cudaMemcpy(gradient.data(), grads.data, gradient.size() * sizeof(float), cudaMemcpyDeviceToHost), "download");
    if (cfg.zero == 0) {
      for (std::size_t e = 0; e < host.size(); ++e) host[e] -= cfg.sgd_lr * gradient[e];
      continue;
    }
    adamw.step(gradient, host);
  }
  return host;
}

// This rank's training on its shard of every batch; returns the final parameters.
std::vector<float> train(cohort::process_group<cohort::nccl>& pg, const config& cfg, const flat_layout& layout,
                         cudaStream_t stream) {
  cohort::rank_logger log(pg);
  const batches data(cfg);
  const std::vector<float> initial = initial_parameters(cfg, layout);
  device_tensor params(layout.elements), grads(layout.elements);
  check(cudaMemcpy(params.data, initial.data(), initial.size() * sizeof(float), cudaMemcpyHostToDevice), "upload");
  const int shard = cfg.batch / pg.size();
  std::unique_ptr<cohort::gradient_reducer<cohort::nccl>> ddp;
  std::unique_ptr<cohort::zero_optimizer<cohort::nccl, float>> zero;
  if (cfg.zero == 0) {
    ddp = std::make_unique<cohort::gradient_reducer<cohort::nccl>>(
        pg, cohort::flat_gradients(grads.span(), layout.regions),
        cohort::reducer_options{.first_bucket_bytes = 16 << 10, .bucket_bytes = 64 << 10, .in_place = true});
    ddp->set_stream(stream);
    log(layout.regions.size(), " tensors in ", ddp->bucket_count(), " buckets, ", ddp->run_count(),
        " grouped all-reduces per step, gradient bytes copied per step ", ddp->copied_bytes_per_step());
  } else {
    zero = std::make_unique<cohort::zero_optimizer<cohort::nccl, float>>(
        pg, params.span(), grads.span(), layout.regions,
        cohort::zero_options{.stage = cfg.zero,
                             .bucket_bytes = 32 << 10,
                             .adam = cfg.adam,
                             .max_grad_norm = cfg.max_grad_norm,
                             .decay = layout.decay});
    zero->set_stream(stream);
    log("ZeRO-", cfg.zero, ": optimizer state ", zero->optimizer_state_bytes(), " bytes on this rank of ",
        3 * layout.elements * sizeof(float), ", ", zero->wire_bytes_per_step(), " bytes on the wire per step");
  }
  for (int step = 0; step < cfg.steps; ++step) {
    const std::size_t first = static_cast<std::size_t>(step * cfg.batch + pg.rank() * shard);
    const float loss = forward_backward(
        cfg, layout, params.data, grads.data, data.x(cfg, first), data.y(cfg, first), shard,
        [&](std::size_t t) { ddp ? ddp->mark_ready(t) : zero->mark_ready(t); }, stream);
    if (ddp) {
      ddp->finish();  // the stream waits for the averaged gradients
      sgd<<<blocks(layout.elements), 256, 0, stream>>>(params.data, grads.data, static_cast<int>(layout.elements),
                                                       cfg.sgd_lr);
    } else {
      const auto result = zero->step();
      if (step % 4 == 0) log("step ", step, " shard loss ", loss, " grad norm ", result.grad_norm);
    }
  }
  check(cudaStreamSynchronize(stream), "train");
  std::vector<float> final_parameters(layout.elements);
  check(cudaMemcpy(final_parameters.data(), params.data, layout.elements * sizeof(float), cudaMemcpyDeviceToHost),
        "download");
  return final_parameters;
}

}  // namespace

int main(int argc, char** argv) try {
  config cfg;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string arg = argv[i];
    if (arg == "--zero")
      cfg.zero = std::atoi(argv[i + 1]);
    else if (arg == "--steps")
      cfg.steps = std::atoi(argv[i + 1]);
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("zero_cuda: no CUDA device; nothing to do\n");
    return 77;
  }
  const auto env = cohort::launch_env::detect();
  auto store = env.world_size == 1 ? std::shared_ptr<cohort::store>(std::make_shared<cohort::memory_store>())
                                   : cohort::connect_store(env);
  cohort::process_group<cohort::nccl> pg{store, env};
  if (cfg.batch % pg.size() != 0) throw std::runtime_error("the batch does not split over the ranks");
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  const auto layout = flat_layout::of(mlp(cfg.widths));
  const auto trained = train(pg, cfg, layout, stream);
  int status = 0;
  if (cohort::is_main_process(pg)) {
    const auto single = train_single(cfg, layout, stream);
    double worst = 0;
    for (std::size_t e = 0; e < single.size(); ++e) worst = std::max(worst, std::abs(double(trained[e]) - single[e]));
    const bool match = worst <= 1e-5;
    std::printf("final parameters: %s, %d GPU(s), against one process: max |difference| %.2e: %s\n",
                cfg.zero == 0   ? "flat-buffer data-parallel"
                : cfg.zero == 1 ? "ZeRO-1"
                                : "ZeRO-2",
                pg.size(), worst, match ? "match" : "MISMATCH");
    status = match ? 0 : 1;
  }
  pg.barrier().wait();  // the others wait for the reference: rank 0 hosts the store
  cudaStreamDestroy(stream);
  return status;
} catch (const std::exception& failure) {
  std::fprintf(stderr, "zero_cuda: %s\n", failure.what());
  return 1;
}
