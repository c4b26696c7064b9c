#pragma once
// The examples' MLP (mlp.hpp) as CUDA kernels: forward, the backward's pieces and plain SGD,
// shared by the .cu examples (each a program of one translation unit, so the kernels are
// defined once per program).
#include <cuda_runtime.h>

#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>

namespace cohort_examples {

inline void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

__global__ void forward_layer(const float* w, const float* b, const float* x, float* y, int batch, int in, int out,
                              bool hidden) {
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= batch * out) return;
  const int s = k / out, o = k % out;
  float sum = b[o];
  for (int i = 0; i < in; ++i) sum += w[o * in + i] * x[s * in + i];
  y[k] = hidden ? tanhf(sum) : sum;
}
__global__ void output_delta(const float* y, const float* target, float* delta, int count) {
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k < count) delta[k] = 2.0f * (y[k] - target[k]) / static_cast<float>(count);
}
__global__ void bias_gradient(const float* delta, float* gb, int batch, int out) {
  const int o = blockIdx.x * blockDim.x + threadIdx.x;
  if (o >= out) return;
  float sum = 0;
  for (int s = 0; s < batch; ++s) sum += delta[s * out + o];
  gb[o] = sum;
}
__global__ void weight_gradient(const float* delta, const float* a, float* gw, int batch, int in, int out) {
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= in * out) return;
  const int o = k / in, i = k % in;
  float sum = 0;
  for (int s = 0; s < batch; ++s) sum += delta[s * out + o] * a[s * in + i];
  gw[k] = sum;
}
__global__ void previous_delta(const float* delta, const float* w, const float* a, float* previous, int batch, int in,
                               int out) {
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k >= batch * in) return;
  const int s = k / in, i = k % in;
  float sum = 0;
  for (int o = 0; o < out; ++o) sum += delta[s * out + o] * w[o * in + i];
  previous[k] = sum * (1.0f - a[k] * a[k]);
}
__global__ void sgd(float* p, const float* g, int n, float lr) {
  const int k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k < n) p[k] -= lr * g[k];
}

inline unsigned blocks(std::size_t n) { return static_cast<unsigned>((n + 255) / 256); }

struct device_tensor {
  float* data = nullptr;
  std::size_t count = 0;
  explicit device_tensor(std::size_t n) : count(n) { check(cudaMalloc(&data, n * sizeof(float)), "cudaMalloc"); }
  device_tensor(const device_tensor&) = delete;
  device_tensor(device_tensor&& other) noexcept : data(other.data), count(other.count) { other.data = nullptr; }
  device_tensor& operator=(device_tensor&& other) noexcept {
    std::swap(data, other.data);
    std::swap(count, other.count);
    return *this;
  }
  ~device_tensor() { cudaFree(data); }
  std::span<float> span() const { return {data, count}; }
};

}  // namespace cohort_examples
