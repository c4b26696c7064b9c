// Sharded parameters on NCCL with one rank on one GPU: the device path of the same template
// (gathers into cudaMalloc'd pooled buffers ordered with a caller stream, the gradient
// kernels, SGD and Adam kernels, device checkpoints). Skipped without a GPU. A plain C++ file:
// the kernels come compiled from cohort_self_impl (COHORT_SEPARATE_DEVICE_CODE).
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <cohort/backend/nccl.hpp>
#include <cohort/optim.hpp>
#include <cohort/sharded.hpp>
#include <cohort/store.hpp>

#include "support.hpp"

#if !defined(COHORT_SEPARATE_DEVICE_CODE) || defined(__CUDACC__)
#error "test_sharded_nccl.cpp is the plain C++ test of the kernels cohort_self_impl compiled"
#endif

namespace {

using group = cohort::process_group<cohort::nccl>;
using sharded = cohort::sharded_parameters<cohort::nccl, float>;

void require_gpu() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
    cohort_test::skip("no CUDA device on this machine: the device sharded tests need a GPU");
}

group make_group() {
  cohort::nccl::options opts;
  opts.timeout = std::chrono::seconds(20);
  return group(std::make_shared<cohort::memory_store>(), cohort::launch_env::explicit_ranks(0, 1), opts);
}

template <class E>
std::vector<E> download(std::span<E> device) {
  std::vector<E> host(device.size());
  REQUIRE(cudaMemcpy(host.data(), device.data(), device.size() * sizeof(E), cudaMemcpyDeviceToHost) == cudaSuccess);
  return host;
}

const std::vector<std::vector<std::size_t>> units{{5, 3}, {1}, {300, 20}};

std::vector<std::vector<float>> originals() {
  std::vector<std::vector<float>> all;
  for (std::size_t u = 0; u < units.size(); ++u)
    for (std::size_t p = 0; p < units[u].size(); ++p) {
      all.emplace_back(units[u][p]);
      for (std::size_t i = 0; i < units[u][p]; ++i) all.back()[i] = static_cast<float>(u * 1000 + p * 100) + 0.25f * i;
    }
  return all;
}

}  // namespace

TEST_CASE("device gathers return the original parameters, in fp32 and bfloat16", "[sharded][nccl]") {
  require_gpu();
  auto pg = make_group();
  cudaStream_t stream;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  const auto full = originals();
  sharded fp32(pg, units, {.prefetch = 1});
  sharded bf16(pg, units, {.prefetch = 1, .gather_type = cohort::dtype::bfloat16});
  fp32.set_stream(stream);
  bf16.set_stream(stream);
  fp32.init_from_full(full);  // host sources: the backend's copy reads any memory
  bf16.scatter_from(0, full);
  std::size_t t = 0;
  for (std::size_t u = 0; u < units.size(); ++u) {
    auto a = fp32.gather(u);
    auto b = bf16.gather(u);
    for (std::size_t p = 0; p < units[u].size(); ++p, ++t) {
      auto values = a.param(p);
      auto rounded = b.param<cohort::bfloat16>(p);
      REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
      const auto got = download(values);
      const auto got16 = download(rounded);
      for (std::size_t i = 0; i < got.size(); ++i) {
        REQUIRE(got[i] == full[t][i]);
        REQUIRE(got16[i] == cohort::bfloat16(full[t][i]));
      }
    }
  }
  CHECK(fp32.memory().gathered == 0);
  CHECK(fp32.gather_full_state(0) == full);
  cudaStreamDestroy(stream);
}

TEST_CASE("device gradients, SGD and Adam match the formulas computed on the host", "[sharded][nccl]") {
  require_gpu();
  auto pg = make_group();
  const auto full = originals();
  for (int kind = 0; kind < 2; ++kind) {
    sharded params(pg, units, {.reduce_type = cohort::dtype::float64});
    params.init_from_full(full);
    cohort::sgd sgd(params, {.lr = 0.1, .momentum = 0.9});
    cohort::adam adam(params, {.lr = 0.01});
    std::vector<std::vector<float>> expected = full, m, v;
    for (auto& p : full) {
      m.emplace_back(p.size(), 0.0f);
      v.emplace_back(p.size(), 0.0f);
    }
    for (int step = 1; step <= 2; ++step) {
      std::size_t t = 0;
      for (std::size_t u = 0; u < units.size(); ++u) {
        std::vector<float> host(params.unit_elements(u));
        for (std::size_t i = 0; i < host.size(); ++i) host[i] = std::sin(0.1f * i + step + u);
        float* device = nullptr;
        REQUIRE(cudaMalloc(&device, host.size() * sizeof(float)) == cudaSuccess);
        REQUIRE(cudaMemcpy(device, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
        params.reduce_scatter_grad(u, std::span<const float>(device, host.size())).wait();
        cudaFree(device);
        std::size_t offset = 0;
        for (std::size_t p = 0; p < units[u].size(); ++p, ++t)
          for (std::size_t i = 0; i < units[u][p]; ++i) {
            const float g = host[offset++];
            float& w = expected[t][i];
            if (kind == 0) {
              m[t][i] = 0.9f * m[t][i] + g;
              w -= 0.1f * m[t][i];
            } else {
              m[t][i] = 0.9f * m[t][i] + 0.1f * g;
              v[t][i] = 0.999f * v[t][i] + static_cast<float>(1 - 0.999) * g * g;
              const float mh = m[t][i] / static_cast<float>(1 - std::pow(0.9, step));
              const float vh = v[t][i] / static_cast<float>(1 - std::pow(0.999, step));
              w -= 0.01f * (mh / (std::sqrt(vh) + 1e-8f));
            }
          }
      }
      (kind == 0 ? sgd.step() : adam.step()).wait();
    }
    const auto got = params.gather_full_state(0);
    double worst = 0;
    for (std::size_t t = 0; t < got.size(); ++t)
      for (std::size_t i = 0; i < got[t].size(); ++i)
        worst = std::max(worst, std::abs(double(got[t][i]) - expected[t][i]));
    INFO((kind == 0 ? "sgd" : "adam"));
    CHECK(worst <= 1e-4);
    const auto directory = std::filesystem::temp_directory_path() / ("cohort_sharded_cuda_" + std::to_string(kind));
    params.save_sharded(directory, kind == 0 ? static_cast<cohort::sharded_optimizer_state<float>*>(&sgd) : &adam);
    sharded loaded(pg, units);
    loaded.load_sharded(directory);
    CHECK(loaded.gather_full_state(0) == got);
    std::filesystem::remove_all(directory);
  }
}
