// Data-parallel training of a small MLP on GPUs, with NCCL and cohort's gradient reducer:
// the CUDA twin of data_parallel.cpp. The forward and backward run as kernels on a caller
// stream; the reducer's buckets are all-reduced on NCCL's stream as the backward fills them,
// and finish() makes the caller's stream wait instead of blocking the host.
//
//   data_parallel_cuda                                  # one GPU
//   torchrun --nproc-per-node 2 --no-python data_parallel_cuda     # or mpirun -np 2
//
// At the end the main rank trains a single process on the whole batch with the same kernels
// and checks that both reach the same loss.
#include <cohort/backend/nccl.hpp>
#include <cohort/guards.hpp>
#include <cohort/launch.hpp>
#include <cohort/reducer.hpp>
#include <cohort/store.hpp>
#include <cohort/tcp_store.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "mlp.hpp"
#include "mlp_kernels.cuh"

namespace {

using namespace cohort_examples;  // the kernels of mlp_kernels.cuh

// The MLP of mlp.hpp, on the GPU: parameters, activations and the backward as kernels.
class device_mlp {
 public:
  device_mlp(std::vector<std::size_t> widths, cudaStream_t stream) : widths_(std::move(widths)), stream_(stream) {
    cohort_examples::mlp host(widths_);
    std::vector<std::vector<float>> values;
    for (auto n : host.parameter_sizes()) values.emplace_back(n);
    std::vector<std::span<float>> spans(values.begin(), values.end());
    host.initialize(spans, 7);
    for (auto& v : values) {
      params_.emplace_back(v.size());
      check(cudaMemcpy(params_.back().data, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice), "upload");
    }
  }
  std::vector<std::size_t> sizes() const { return cohort_examples::mlp(widths_).parameter_sizes(); }
  std::size_t layers() const { return widths_.size() - 1; }

  // Loss of the batch (x, y on the device) and gradients into `grads`; on_ready(t) as each
  // gradient's kernel has been queued, back to front.
  float step(const float* x, const float* y, int batch, const std::vector<std::span<float>>& grads,
             const std::function<void(std::size_t)>& on_ready) {
    std::vector<device_tensor> activation;
    activation.emplace_back(static_cast<std::size_t>(batch) * widths_[0]);
    check(
        cudaMemcpyAsync(activation[0].data, x, activation[0].count * sizeof(float), cudaMemcpyDeviceToDevice, stream_),
        "copy");
    for (std::size_t l = 0; l < layers(); ++l) {
      const int in = static_cast<int>(widths_[l]), out = static_cast<int>(widths_[l + 1]);
      activation.emplace_back(static_cast<std::size_t>(batch) * out);
      forward_layer<<<blocks(activation.back().count), 256, 0, stream_>>>(params_[2 * l].data, params_[2 * l + 1].data,
                                                                          activation[l].data, activation.back().data,
                                                                          batch, in, out, l + 1 < layers());
    }
    const std::size_t outputs = activation.back().count;
    device_tensor delta(outputs);
    output_delta<<<blocks(outputs), 256, 0, stream_>>>(activation.back().data, y, delta.data,
                                                       static_cast<int>(outputs));
    std::vector<float> prediction(outputs), target(outputs);
    check(cudaMemcpyAsync(prediction.data(), activation.back().data, outputs * sizeof(float), cudaMemcpyDeviceToHost,
                          stream_),
          "download");
    check(cudaMemcpyAsync(target.data(), y, outputs * sizeof(float), cudaMemcpyDeviceToHost, stream_), "download");
    for (std::size_t l = layers(); l-- > 0;) {
      const int in = static_cast<int>(widths_[l]), out = static_cast<int>(widths_[l + 1]);
      bias_gradient<<<blocks(out), 256, 0, stream_>>>(delta.data, grads[2 * l + 1].data(), batch, out);
      if (on_ready) on_ready(2 * l + 1);
      weight_gradient<<<blocks(grads[2 * l].size()), 256, 0, stream_>>>(delta.data, activation[l].data,
                                                                        grads[2 * l].data(), batch, in, out);
      if (on_ready) on_ready(2 * l);
      if (l == 0) break;
      device_tensor previous(static_cast<std::size_t>(batch) * in);
      previous_delta<<<blocks(previous.count), 256, 0, stream_>>>(delta.data, params_[2 * l].data, activation[l].data,
                                                                  previous.data, batch, in, out);
      delta = std::move(previous);
    }
    check(cudaGetLastError(), "kernel launch");
    check(cudaStreamSynchronize(stream_), "loss");  // the loss is read on the host (the backward is queued)
    double loss = 0;
    for (std::size_t k = 0; k < outputs; ++k)
      loss += (prediction[k] - target[k]) * static_cast<double>(prediction[k] - target[k]);
    return static_cast<float>(loss / static_cast<double>(outputs));
  }

  void update(const std::vector<std::span<float>>& grads, float lr) {
    for (std::size_t t = 0; t < params_.size(); ++t)
      sgd<<<blocks(params_[t].count), 256, 0, stream_>>>(params_[t].data, grads[t].data(),
                                                         static_cast<int>(params_[t].count), lr);
  }

 private:
  std::vector<std::size_t> widths_;
  cudaStream_t stream_;
  std::vector<device_tensor> params_;
};

struct config {
  int steps = 12;
  int batch = 48;
  float lr = 0.1f;
  std::vector<std::size_t> widths{32, 192, 192, 8};
};

// Trains on shard `rank` of `world` of every batch. With a reducer, gradients are averaged
// across ranks; without, this is the single-process reference. Returns the last step's loss.
float train(const config& cfg, int rank, int world, cohort::gradient_reducer<cohort::nccl>* ddp,
            const std::function<void(int, float)>& report, cudaStream_t stream) {
  device_mlp model(cfg.widths, stream);
  const auto data = cohort_examples::synthetic_data::make(static_cast<std::size_t>(cfg.batch * cfg.steps),
                                                          cfg.widths.front(), cfg.widths.back(), 2024);
  device_tensor inputs(data.inputs.size()), targets(data.targets.size());
  check(cudaMemcpy(inputs.data, data.inputs.data(), data.inputs.size() * sizeof(float), cudaMemcpyHostToDevice),
        "upload");
  check(cudaMemcpy(targets.data, data.targets.data(), data.targets.size() * sizeof(float), cudaMemcpyHostToDevice),
        "upload");
  std::vector<device_tensor> own_grads;
  std::vector<std::span<float>> grads;
  if (!ddp) {
    for (auto n : model.sizes()) own_grads.emplace_back(n);
    for (auto& g : own_grads) grads.push_back(g.span());
  }
  const int shard = cfg.batch / world;
  float loss = 0;
  for (int step = 0; step < cfg.steps; ++step) {
    if (ddp) grads = ddp->gradients();
    const std::size_t first = static_cast<std::size_t>(step * cfg.batch + rank * shard);
    loss = model.step(inputs.data + first * cfg.widths.front(), targets.data + first * cfg.widths.back(), shard, grads,
                      [&](std::size_t t) {
                        if (ddp) ddp->mark_ready(t);
                      });
    if (ddp) ddp->finish();  // the stream now waits for the averaged gradients
    model.update(grads, cfg.lr);
    if (report) report(step, loss);
  }
  check(cudaStreamSynchronize(stream), "train");
  return loss;
}

}  // namespace

int main(int argc, char** argv) try {
  config cfg;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string arg = argv[i];
    if (arg == "--steps")
      cfg.steps = std::atoi(argv[i + 1]);
    else if (arg == "--batch")
      cfg.batch = std::atoi(argv[i + 1]);
    else if (arg == "--lr")
      cfg.lr = static_cast<float>(std::atof(argv[i + 1]));
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("data_parallel_cuda: no CUDA device; nothing to do\n");
    return 77;
  }
  const auto env = cohort::launch_env::detect();
  auto store = env.world_size == 1 ? std::shared_ptr<cohort::store>(std::make_shared<cohort::memory_store>())
                                   : cohort::connect_store(env);
  cohort::process_group<cohort::nccl> pg{store, env};
  if (cfg.batch % pg.world_size() != 0) throw std::runtime_error("--batch must be divisible by the world size");
  cohort::rank_logger log(pg);
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");

  float last = 0;  // the whole batch's loss at the last step
  {
    const auto sizes = cohort_examples::mlp(cfg.widths).parameter_sizes();
    cohort::gradient_reducer<cohort::nccl> ddp(pg, sizes, {.first_bucket_bytes = 16 << 10, .bucket_bytes = 64 << 10});
    ddp.set_stream(stream);
    log(sizes.size(), " tensors in ", ddp.bucket_count(), " buckets, ", pg.world_size(), " GPU(s)");
    // Loss of the whole batch: the average of the shard losses, through NCCL.
    float* device_loss = nullptr;
    check(cudaMalloc(&device_loss, sizeof(float)), "cudaMalloc");
    train(
        cfg, pg.rank(), pg.world_size(), &ddp,
        [&](int step, float loss) {
          check(cudaMemcpy(device_loss, &loss, sizeof loss, cudaMemcpyHostToDevice), "upload");
          pg.all_reduce(std::span<float>(device_loss, 1), cohort::op::avg).wait();
          check(cudaMemcpy(&loss, device_loss, sizeof loss, cudaMemcpyDeviceToHost), "download");
          log("step ", step, " loss ", loss);
          last = loss;
        },
        stream);
    cudaFree(device_loss);
  }
  int status = 0;
  if (cohort::is_main_process(pg)) {
    // The reference sees the whole batch; its last-step loss is the batch loss the ranks averaged.
    const float single = train(cfg, 0, 1, nullptr, {}, stream);
    const float difference = std::abs(last - single);
    const bool match = difference <= 1e-5f;
    std::printf("final loss: data-parallel %.7f, single GPU %.7f, |difference| %.2e: %s\n", last, single, difference,
                match ? "match" : "MISMATCH");
    status = match ? 0 : 1;
  }
  pg.barrier().wait();  // the others wait for the reference: rank 0 hosts the store
  cudaStreamDestroy(stream);
  return status;
} catch (const std::exception& failure) {
  std::fprintf(stderr, "data_parallel_cuda: %s\n", failure.what());
  return 1;
}
