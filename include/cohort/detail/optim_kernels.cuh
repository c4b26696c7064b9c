#pragma once
// CUDA kernels behind cohort/sharded.hpp and cohort/optim.hpp: gradient accumulation into
// the master-precision shard, and the SGD and Adam updates of a local shard. Included only
// when nvcc compiles the translation unit; the per-element formulas are the host's own
// (detail::sgd_update, detail::adam_update in sharded.hpp), so both sides compute the same.

#include <cuda_runtime.h>

#include <cstddef>

#include "cohort/detail/device_ops.cuh"
#include "cohort/types.hpp"

namespace cohort::inline v0::detail::device {

template <class From, class To>
__global__ void accumulate_kernel(const From* in, To* out, std::size_t count, bool accumulate) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const To value = static_cast<To>(to_float(in[i]));
    out[i] = accumulate ? static_cast<To>(out[i] + value) : value;
  }
}

// out (To) = [out +] (To) in (From), on `stream`.
template <class To>
void accumulate_into(const void* in, dtype from, To* out, std::size_t count, bool accumulate, cudaStream_t stream) {
  if (count == 0) return;
  for_dtype(from, [&](auto sample) {
    using F = decltype(sample);
    accumulate_kernel<F, To><<<blocks_for(count), 256, 0, stream>>>(static_cast<const F*>(in), out, count, accumulate);
  });
  check_launch("accumulate_gradient");
}

template <class T>
__global__ void sgd_kernel(T* parameters, const T* gradients, T* momentum, std::size_t count,
                           sgd_coefficients coefficients) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    sgd_update(parameters[i], gradients[i], momentum ? momentum + i : nullptr, coefficients);
}

template <class T>
void sgd_step(T* parameters, const T* gradients, T* momentum, std::size_t count, const sgd_coefficients& coefficients,
              cudaStream_t stream) {
  if (count == 0) return;
  sgd_kernel<T><<<blocks_for(count), 256, 0, stream>>>(parameters, gradients, momentum, count, coefficients);
  check_launch("sgd_step");
}

template <class T>
__global__ void adam_kernel(T* parameters, const T* gradients, T* first, T* second, std::size_t count,
                            adam_coefficients coefficients) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    adam_update(parameters[i], gradients[i], first[i], second[i], coefficients);
}

template <class T>
void adam_step(T* parameters, const T* gradients, T* first, T* second, std::size_t count,
               const adam_coefficients& coefficients, cudaStream_t stream) {
  if (count == 0) return;
  adam_kernel<T><<<blocks_for(count), 256, 0, stream>>>(parameters, gradients, first, second, count, coefficients);
  check_launch("adam_step");
}

}  // namespace cohort::inline v0::detail::device
