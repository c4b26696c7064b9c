#pragma once
// The device system's element-wise kernels, over the formulas of comm/detail/elementwise.hpp, and
// the launchers comm/detail/device_elementwise.hpp declares. nvcc compiles this header: in each
// .cu translation unit that uses the device backend's algorithms (header-only), or once in the
// program's cohort library (COHORT_SEPARATE_COMPILATION, cohort/src.cu).
//
// One kernel per operation, whatever the dtypes: the dtype is a kernel argument and each
// kernel switches on it once, outside its loop. A program so compiles a handful of kernels
// rather than one per operation and dtype (pair), and the branch costs nothing per element.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include "cohort/comm/detail/device_elementwise.hpp"
#include "cohort/comm/detail/elementwise.hpp"
#include "cohort/comm/detail/exact_squares.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0::detail {

namespace device {

inline unsigned blocks_for(std::size_t count, unsigned threads = 256) {
  const std::size_t wanted = (count + threads - 1) / threads;
  return static_cast<unsigned>(wanted < 65535 * 8 ? (wanted == 0 ? 1 : wanted) : 65535 * 8);
}

inline void check_launch(const char* what) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess)
    throw error(-1, detail::text("cuda.launch(", what, ")"), cudaGetErrorString(status),
                "was this binary built for this GPU's architecture (CMAKE_CUDA_ARCHITECTURES)?");
}

__device__ inline std::size_t first_index() { return blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; }
__device__ inline std::size_t stride() { return static_cast<std::size_t>(gridDim.x) * blockDim.x; }

// The kernels are templates (of nothing) so that a trainer whose .cu files all include this
// header still links: template kernels are emitted once, plain ones once per file.

// Calls body(T{}) with T the host storage type of `type` (device code, uniform branch).
#define COHORT_DEVICE_DTYPE_CASE(name, host, text, floating, nccl, cuda) \
  case dtype::name: body(host{}); return;
template <class Body>
__device__ inline void on_dtype(dtype type, Body&& body) {
  switch (type) { COHORT_DTYPES(COHORT_DEVICE_DTYPE_CASE) }
}
#undef COHORT_DEVICE_DTYPE_CASE
#define COHORT_DEVICE_FLOATING_CASE(name, host, text, floating, nccl, cuda) \
  case dtype::name:                                                         \
    if constexpr (floating) body(host{});                                   \
    return;
template <class Body>
__device__ inline void on_floating(dtype type, Body&& body) {
  switch (type) { COHORT_DTYPES(COHORT_DEVICE_FLOATING_CASE) }
}
#undef COHORT_DEVICE_FLOATING_CASE

template <class Unique = void>
__global__ void divide_kernel(void* data, std::size_t count, dtype type, int divisor) {
  on_dtype(type, [&](auto sample) {
    using T = decltype(sample);
    T* x = static_cast<T*>(data);
    for (std::size_t i = first_index(); i < count; i += stride()) x[i] = divided(x[i], divisor);
  });
}

template <class Unique = void>
__global__ void scale_kernel(void* data, std::size_t count, dtype type, double factor) {
  on_floating(type, [&](auto sample) {
    using T = decltype(sample);
    T* x = static_cast<T*>(data);
    for (std::size_t i = first_index(); i < count; i += stride()) x[i] = scaled(x[i], factor);
  });
}

template <class Unique = void>
__global__ void convert_kernel(const void* in, dtype from, void* out, dtype to, std::size_t count, bool add) {
  on_floating(from, [&](auto source) {
    on_floating(to, [&](auto target) {
      using F = decltype(source);
      using T = decltype(target);
      const F* x = static_cast<const F*>(in);
      T* y = static_cast<T*>(out);
      if (add)
        for (std::size_t i = first_index(); i < count; i += stride()) y[i] = added(y[i], converted<T>(x[i]));
      else
        for (std::size_t i = first_index(); i < count; i += stride()) y[i] = converted<T>(x[i]);
    });
  });
}

// A fill writes a bit pattern of the dtype's width, made on the host from the value.
// One thread per element, its tree in registers: the parts read once, the sum written once.
template <class Unique = void>
__global__ void canonical_sum_parts_kernel(const void* parts, std::size_t part_count, std::size_t count, dtype type,
                                           int divisor, void* out) {
  on_floating(type, [&](auto sample) {
    using T = decltype(sample);
    const T* x = static_cast<const T*>(parts);
    T* y = static_cast<T*>(out);
    for (std::size_t i = first_index(); i < count; i += stride()) {
      const T sum = canonical_tree_sum<T>(part_count, [&](std::size_t p) { return x[p * count + i]; });
      y[i] = divisor != 0 ? divided(sum, divisor) : sum;
    }
  });
}

template <class Unique = void>
__global__ void fill_kernel(void* data, std::size_t count, unsigned width, std::uint64_t pattern) {
  const auto run = [&](auto sample) {
    using W = decltype(sample);
    W* x = static_cast<W*>(data);
    const W v = static_cast<W>(pattern);
    for (std::size_t i = first_index(); i < count; i += stride()) x[i] = v;
  };
  switch (width) {
    case 1: run(std::uint8_t{}); return;
    case 2: run(std::uint16_t{}); return;
    case 4: run(std::uint32_t{}); return;
    default: run(std::uint64_t{}); return;
  }
}

template <class Unique = void>
__global__ void nonfinite_kernel(const void* data, std::size_t count, dtype type, unsigned long long* result) {
  unsigned long long bad = 0;
  on_floating(type, [&](auto sample) {
    using T = decltype(sample);
    const T* x = static_cast<const T*>(data);
    for (std::size_t i = first_index(); i < count; i += stride()) bad += nonfinite(x[i]);
  });
  if (bad) atomicAdd(result, bad);
}

// Squares summed in double per thread, then one atomicAdd per thread that found any.
template <class Unique = void>
__global__ void squares_kernel(const void* data, std::size_t count, dtype type, double* result) {
  double sum = 0;
  on_floating(type, [&](auto sample) {
    using T = decltype(sample);
    const T* x = static_cast<const T*>(data);
    for (std::size_t i = first_index(); i < count; i += stride()) sum += squared(x[i]);
  });
  if (sum != 0) atomicAdd(result, sum);
}

// exact_squares.hpp's bins of one dtype: each element's m^2 added in pieces below 2^limb_bits
// to the block's bins in shared memory, then the block's nonzero words to the global ones, all
// by integer atomicAdd: exact, so no order the threads add in changes the sums. The shared
// bins are sized for the widest layout (double: 2048 bins x 6 words, 96 KiB, dynamic).
template <class Unique = void>
__global__ void exact_squares_kernel(const void* data, std::size_t count, dtype type, unsigned long long* words) {
  extern __shared__ unsigned long long block_words[];
  on_floating(type, [&](auto sample) {
    using T = decltype(sample);
    constexpr auto layout = exact_squares_layout_v<T>;
    constexpr int pieces =
        (layout.square_bits() + exact_squares_layout::limb_bits - 1) / exact_squares_layout::limb_bits;
    for (int w = threadIdx.x; w < layout.words(); w += blockDim.x) block_words[w] = 0;
    __syncthreads();
    const T* x = static_cast<const T*>(data);
    for (std::size_t i = first_index(); i < count; i += stride()) {
      const auto term = exact_square_of(x[i]);
      unsigned long long* bin = block_words + term.bin * layout.limbs();
      // m^2 as two 64-bit halves (a double's is 106 bits), cut into the limbs' pieces.
      const unsigned long long low = term.significand * term.significand;
      unsigned long long high = __umul64hi(term.significand, term.significand);
      unsigned long long rest = low;
      for (int piece = 0; piece < pieces; ++piece) {
        const unsigned long long part = rest & exact_squares_layout::limb_mask;
        if (part) atomicAdd(bin + piece, part);
        // Down by limb_bits, the high half's low bits moving into the low one.
        rest = (rest >> exact_squares_layout::limb_bits) | (high << (64 - exact_squares_layout::limb_bits));
        high >>= exact_squares_layout::limb_bits;
      }
    }
    __syncthreads();
    for (int w = threadIdx.x; w < layout.words(); w += blockDim.x)
      if (block_words[w]) atomicAdd(words + w, block_words[w]);
  });
}

// Up to 64 regions per launch, passed by value (1.5 KiB of kernel parameters); blockIdx.y
// picks the region, blocks stride over its bytes in 16-byte words when aligned.
struct region_batch {
  static constexpr int capacity = 64;
  char* destination[capacity];
  const char* source[capacity];
  std::size_t bytes[capacity];
};

template <class Unique = void>
__global__ void batched_copy_kernel(region_batch batch) {
  const int region = blockIdx.y;
  char* destination = batch.destination[region];
  const char* source = batch.source[region];
  const std::size_t bytes = batch.bytes[region];
  const bool aligned =
      ((reinterpret_cast<std::uintptr_t>(destination) | reinterpret_cast<std::uintptr_t>(source)) & 15u) == 0;
  std::size_t done = 0;
  if (aligned) {
    const std::size_t words = bytes / 16;
    auto* d = reinterpret_cast<uint4*>(destination);
    const auto* s = reinterpret_cast<const uint4*>(source);
    for (std::size_t i = first_index(); i < words; i += stride()) d[i] = s[i];
    done = words * 16;
  }
  for (std::size_t i = done + first_index(); i < bytes; i += stride()) destination[i] = source[i];
}

template <class T>
__global__ void sgd_kernel(T* parameters, const T* gradients, T* momentum, std::size_t count, sgd_coefficients c) {
  for (std::size_t i = first_index(); i < count; i += stride())
    sgd_update(parameters[i], gradients[i], momentum ? momentum + i : nullptr, c);
}

template <class T>
__global__ void adam_kernel(T* parameters, const T* gradients, T* first, T* second, std::size_t count,
                            adam_coefficients c) {
  for (std::size_t i = first_index(); i < count; i += stride())
    adam_update(parameters[i], gradients[i], first[i], second[i], c);
}

COHORT_DECL void launch_divide(cudaStream_t stream, void* data, std::size_t count, dtype type, int divisor) {
  if (count == 0) return;
  divide_kernel<><<<blocks_for(count), 256, 0, stream>>>(data, count, type, divisor);
  check_launch("divide");
}

COHORT_DECL void launch_scale(cudaStream_t stream, void* data, std::size_t count, dtype type, double factor) {
  if (count == 0) return;
  scale_kernel<><<<blocks_for(count), 256, 0, stream>>>(data, count, type, factor);
  check_launch("scale");
}

COHORT_DECL void launch_convert(cudaStream_t stream, const void* in, dtype from, void* out, dtype to, std::size_t count,
                                bool add) {
  if (count == 0) return;
  convert_kernel<><<<blocks_for(count), 256, 0, stream>>>(in, from, out, to, count, add);
  check_launch(add ? "accumulate" : "cast");
}

COHORT_DECL void launch_fill(cudaStream_t stream, void* data, std::size_t count, dtype type, double value) {
  if (count == 0) return;
  std::uint64_t pattern = 0;
  visit_dtype(type, [&](auto sample) {
    const auto v = converted_value<decltype(sample)>(value);
    std::memcpy(&pattern, &v, sizeof v);
  });
  const auto width = static_cast<unsigned>(size_of(type));
  fill_kernel<><<<blocks_for(count), 256, 0, stream>>>(data, count, width, pattern);
  check_launch("fill");
}

COHORT_DECL void launch_canonical_sum_parts(cudaStream_t stream, const void* parts, std::size_t part_count,
                                            std::size_t count, dtype type, int divisor, void* out) {
  if (count == 0) return;
  canonical_sum_parts_kernel<><<<blocks_for(count), 256, 0, stream>>>(parts, part_count, count, type, divisor, out);
  check_launch("canonical_sum_parts");
}

COHORT_DECL void launch_batched_copy(cudaStream_t stream, std::span<const copy_region> regions) {
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
    batched_copy_kernel<><<<grid, 256, 0, stream>>>(batch);
    check_launch("batched_copy");
  }
}

COHORT_DECL void launch_count_nonfinite(cudaStream_t stream, const void* data, std::size_t count, dtype type,
                                        std::int64_t* result) {
  if (count == 0 || !is_floating(type)) return;
  nonfinite_kernel<>
      <<<blocks_for(count), 256, 0, stream>>>(data, count, type, reinterpret_cast<unsigned long long*>(result));
  check_launch("count_nonfinite");
}

COHORT_DECL void launch_sum_of_squares(cudaStream_t stream, const void* data, std::size_t count, dtype type,
                                       double* result) {
  if (count == 0 || !is_floating(type)) return;
  squares_kernel<><<<blocks_for(count), 256, 0, stream>>>(data, count, type, result);
  check_launch("sum_of_squares");
}

COHORT_DECL void launch_add_exact_squares(cudaStream_t stream, const void* data, std::size_t count, dtype type,
                                          std::int64_t* words) {
  if (count == 0 || !is_floating(type)) return;
  const std::size_t shared_bytes = exact_squares_words(type) * sizeof(unsigned long long);
  static_assert(sizeof(unsigned long long) == sizeof(std::int64_t));
  // Above 48 KiB of shared memory (double's bins) a kernel must ask for it.
  if (shared_bytes > 48 * 1024) {
    const cudaError_t raised = cudaFuncSetAttribute(exact_squares_kernel<>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                    static_cast<int>(shared_bytes));
    if (raised != cudaSuccess)
      throw error(-1, "cuda.launch(add_exact_squares)", cudaGetErrorString(raised),
                  detail::text("a ", std::string(to_string(type)), " gradient's exact norm needs ",
                               std::to_string(shared_bytes),
                               " bytes of shared memory a block (compute capability 7.0 or newer)"));
  }
  exact_squares_kernel<><<<std::min(blocks_for(count), 1024u), 256, shared_bytes, stream>>>(
      data, count, type, reinterpret_cast<unsigned long long*>(words));
  check_launch("add_exact_squares");
}

template <class T>
void launch_sgd(cudaStream_t stream, T* parameters, const T* gradients, T* momentum, std::size_t count,
                const sgd_coefficients& c) {
  if (count == 0) return;
  sgd_kernel<T><<<blocks_for(count), 256, 0, stream>>>(parameters, gradients, momentum, count, c);
  check_launch("sgd_step");
}

template <class T>
void launch_adam(cudaStream_t stream, T* parameters, const T* gradients, T* first, T* second, std::size_t count,
                 const adam_coefficients& c) {
  if (count == 0) return;
  adam_kernel<T><<<blocks_for(count), 256, 0, stream>>>(parameters, gradients, first, second, count, c);
  check_launch("adam_step");
}

}  // namespace device

}  // namespace cohort::inline v0::detail
