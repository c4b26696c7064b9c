#pragma once
// CUDA kernels behind cohort/ops.hpp. Included only when nvcc compiles the translation unit.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <span>

#include "cohort/error.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0::detail::device {

template <class T>
struct math {
  using type = T;
};
template <>
struct math<half> {
  using type = __half;
};
template <>
struct math<bfloat16> {
  using type = __nv_bfloat16;
};

template <class T>
__device__ inline float to_float(T v) {
  return static_cast<float>(v);
}
template <>
__device__ inline float to_float<__half>(__half v) {
  return __half2float(v);
}
template <>
__device__ inline float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <class T>
__device__ inline T from_float(float v) {
  return static_cast<T>(v);
}
template <>
__device__ inline __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <class T>
inline constexpr bool is_16 = std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

inline unsigned blocks_for(std::size_t count, unsigned threads = 256) {
  const std::size_t wanted = (count + threads - 1) / threads;
  return static_cast<unsigned>(wanted < 65535 * 8 ? (wanted == 0 ? 1 : wanted) : 65535 * 8);
}

inline void check_launch(const char* what) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess)
    throw error(-1, std::string("cuda.launch(") + what + ")", cudaGetErrorString(status),
                "was this binary built for this GPU's architecture (CMAKE_CUDA_ARCHITECTURES)?");
}

template <class Fn>
void for_dtype(dtype type, Fn&& fn) {
  switch (type) {
    case dtype::float32: fn(float{}); return;
    case dtype::float64: fn(double{}); return;
    case dtype::float16: fn(__half{}); return;
    case dtype::bfloat16: fn(__nv_bfloat16{}); return;
    case dtype::int32: fn(std::int32_t{}); return;
    case dtype::int64: fn(std::int64_t{}); return;
    case dtype::uint8: fn(std::uint8_t{}); return;
  }
}

template <class T>
__global__ void scale_kernel(T* data, std::size_t count, double factor) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    if constexpr (is_16<T>)
      data[i] = from_float<T>(to_float(data[i]) * static_cast<float>(factor));
    else
      data[i] = static_cast<T>(static_cast<double>(data[i]) * factor);
  }
}

inline void scale(void* data, std::size_t count, dtype type, double factor, cudaStream_t stream) {
  if (count == 0) return;
  for_dtype(type, [&](auto sample) {
    using T = decltype(sample);
    scale_kernel<T><<<blocks_for(count), 256, 0, stream>>>(static_cast<T*>(data), count, factor);
  });
  check_launch("scale");
}

template <class From, class To>
__global__ void cast_kernel(const From* in, To* out, std::size_t count) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    if constexpr (is_16<From> || is_16<To>)
      out[i] = from_float<To>(to_float(in[i]));
    else
      out[i] = static_cast<To>(in[i]);
  }
}

inline void cast(const void* in, dtype from, void* out, dtype to, std::size_t count, cudaStream_t stream) {
  if (count == 0) return;
  for_dtype(from, [&](auto source) {
    for_dtype(to, [&](auto target) {
      using F = decltype(source);
      using T = decltype(target);
      cast_kernel<F, T><<<blocks_for(count), 256, 0, stream>>>(static_cast<const F*>(in), static_cast<T*>(out), count);
    });
  });
  check_launch("cast");
}

template <class T>
__global__ void fill_kernel(T* data, std::size_t count, double value) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    if constexpr (is_16<T>)
      data[i] = from_float<T>(static_cast<float>(value));
    else
      data[i] = static_cast<T>(value);
  }
}

inline void fill(void* data, std::size_t count, dtype type, double value, cudaStream_t stream) {
  if (count == 0) return;
  for_dtype(type, [&](auto sample) {
    using T = decltype(sample);
    fill_kernel<T><<<blocks_for(count), 256, 0, stream>>>(static_cast<T*>(data), count, value);
  });
  check_launch("fill");
}

template <class T>
__global__ void nonfinite_kernel(const T* data, std::size_t count, unsigned long long* result) {
  unsigned long long bad = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    if constexpr (std::is_integral_v<T>) {
    } else if constexpr (is_16<T>) {
      bad += !isfinite(to_float(data[i]));
    } else {
      bad += !isfinite(data[i]);
    }
  }
  if (bad) atomicAdd(result, bad);
}

inline void count_nonfinite(const void* data, std::size_t count, dtype type, std::int64_t* result,
                            cudaStream_t stream) {
  if (count == 0) return;
  for_dtype(type, [&](auto sample) {
    using T = decltype(sample);
    nonfinite_kernel<T><<<blocks_for(count), 256, 0, stream>>>(static_cast<const T*>(data), count,
                                                               reinterpret_cast<unsigned long long*>(result));
  });
  check_launch("count_nonfinite");
}

// Up to 64 regions per launch, passed by value (1.5 KiB of kernel parameters); blockIdx.y
// picks the region, blocks stride over its bytes in 16-byte words when aligned.
struct region_batch {
  static constexpr int capacity = 64;
  char* destination[capacity];
  const char* source[capacity];
  std::size_t bytes[capacity];
};

__global__ void batched_copy_kernel(region_batch batch) {
  const int region = blockIdx.y;
  char* destination = batch.destination[region];
  const char* source = batch.source[region];
  const std::size_t bytes = batch.bytes[region];
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t first = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  const bool aligned =
      ((reinterpret_cast<std::uintptr_t>(destination) | reinterpret_cast<std::uintptr_t>(source)) & 15u) == 0;
  std::size_t done = 0;
  if (aligned) {
    const std::size_t words = bytes / 16;
    auto* d = reinterpret_cast<uint4*>(destination);
    const auto* s = reinterpret_cast<const uint4*>(source);
    for (std::size_t i = first; i < words; i += stride) d[i] = s[i];
    done = words * 16;
  }
  for (std::size_t i = done + first; i < bytes; i += stride) destination[i] = source[i];
}

inline void batched_copy(std::span<const copy_region> regions, cudaStream_t stream) {
  for (std::size_t first = 0; first < regions.size(); first += region_batch::capacity) {
    region_batch batch{};
    const std::size_t n = std::min<std::size_t>(region_batch::capacity, regions.size() - first);
    std::size_t largest = 0;
    for (std::size_t i = 0; i < n; ++i) {
      batch.destination[i] = static_cast<char*>(regions[first + i].destination);
      batch.source[i] = static_cast<const char*>(regions[first + i].source);
      batch.bytes[i] = regions[first + i].bytes;
      largest = std::max(largest, regions[first + i].bytes);
    }
    if (largest == 0) continue;
    const dim3 grid(std::min<unsigned>(blocks_for(largest / 16 + 1), 1024u), static_cast<unsigned>(n));
    batched_copy_kernel<<<grid, 256, 0, stream>>>(batch);
    check_launch("batched_copy");
  }
}

}  // namespace cohort::inline v0::detail::device
