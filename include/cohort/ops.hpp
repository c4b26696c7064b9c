#pragma once
// Element-wise work queued in a backend's own order: on Gloo, tasks on the group's FIFO
// worker; on NCCL, kernels on the group's CUDA stream. Algorithms (reducer, sharded
// parameters) call these so that one implementation runs on both. Host versions are plain
// loops; device versions are in detail/device_ops.cuh and need this translation unit to be
// compiled by nvcc (a clear static_assert says so otherwise).

#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "cohort/detail/host_math.hpp"
#include "cohort/process_group.hpp"
#include "cohort/types.hpp"

#if defined(__CUDACC__)
#include "cohort/detail/device_ops.cuh"
#endif

namespace cohort::inline v0 {

namespace detail {
template <class>
inline constexpr bool needs_nvcc = false;
#define COHORT_REQUIRE_NVCC(B)                                                                   \
  static_assert(::cohort::detail::needs_nvcc<B>,                                                 \
                "cohort: device-side element-wise operations launch CUDA kernels: compile this " \
                "translation unit with nvcc (a .cu file)")
}  // namespace detail

// data *= factor (averaging, loss scaling).
template <backend B>
typename B::work scale(B& engine, void* data, std::size_t count, dtype type, double factor) {
  if constexpr (B::space == memory_space::host) {
    return engine.enqueue([=] {
      visit_dtype(type, [&](auto sample) { detail::scale(static_cast<decltype(sample)*>(data), count, factor); });
    });
  } else {
#if defined(__CUDACC__)
    detail::device::scale(data, count, type, factor, engine.stream());
    return engine.record();
#else
    COHORT_REQUIRE_NVCC(B);
#endif
  }
}

// out = (to) in, element by element (gradient compression, mixed precision).
template <backend B>
typename B::work cast(B& engine, const void* in, dtype from, void* out, dtype to, std::size_t count) {
  if constexpr (B::space == memory_space::host) {
    return engine.enqueue([=] {
      visit_dtype(from, [&](auto source) {
        visit_dtype(to, [&](auto target) {
          detail::cast(static_cast<const decltype(source)*>(in), static_cast<decltype(target)*>(out), count);
        });
      });
    });
  } else {
#if defined(__CUDACC__)
    detail::device::cast(in, from, out, to, count, engine.stream());
    return engine.record();
#else
    COHORT_REQUIRE_NVCC(B);
#endif
  }
}

// Many copies as one operation (one kernel per up to 64 regions on the device), instead of
// one memcpy call per tensor.
template <backend B>
typename B::work batched_copy(B& engine, std::span<const copy_region> regions) {
  if constexpr (B::space == memory_space::host) {
    return engine.enqueue([list = std::vector<copy_region>(regions.begin(), regions.end())] {
      for (const auto& region : list)  // empty regions may carry null pointers, which memmove must not see
        if (region.bytes != 0) std::memmove(region.destination, region.source, region.bytes);
    });
  } else {
#if defined(__CUDACC__)
    detail::device::batched_copy(regions, engine.stream());
    return engine.record();
#else
    COHORT_REQUIRE_NVCC(B);
#endif
  }
}

// *result += number of NaN/Inf elements. `result` lives in the backend's memory space.
template <backend B>
typename B::work count_nonfinite(B& engine, const void* data, std::size_t count, dtype type, std::int64_t* result) {
  if constexpr (B::space == memory_space::host) {
    return engine.enqueue([=] {
      visit_dtype(type, [&](auto sample) {
        *result +=
            static_cast<std::int64_t>(detail::count_nonfinite(static_cast<const decltype(sample)*>(data), count));
      });
    });
  } else {
#if defined(__CUDACC__)
    detail::device::count_nonfinite(data, count, type, result, engine.stream());
    return engine.record();
#else
    COHORT_REQUIRE_NVCC(B);
#endif
  }
}

// data[i] = value.
template <backend B>
typename B::work fill(B& engine, void* data, std::size_t count, dtype type, double value) {
  if constexpr (B::space == memory_space::host) {
    return engine.enqueue([=] {
      visit_dtype(type, [&](auto sample) {
        using T = decltype(sample);
        T* typed = static_cast<T*>(data);
        for (std::size_t i = 0; i < count; ++i) {
          if constexpr (detail::is_16bit_float<T>)
            typed[i] = T(static_cast<float>(value));
          else
            typed[i] = static_cast<T>(value);
        }
      });
    });
  } else {
#if defined(__CUDACC__)
    detail::device::fill(data, count, type, value, engine.stream());
    return engine.record();
#else
    COHORT_REQUIRE_NVCC(B);
#endif
  }
}

}  // namespace cohort::inline v0
