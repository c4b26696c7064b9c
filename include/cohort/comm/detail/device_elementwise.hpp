#pragma once
// The device system's element-wise work (cohort/comm/ops.hpp) as the algorithms call it: each
// entry point launches one kernel on the backend's stream (the caller-order one on the
// caller's) and returns the work that completes with it.
//
// The kernels and their launchers are in comm/detail/device_elementwise.cuh. Header-only, each .cu
// translation unit that uses them compiles them (cohort/comm/ops.hpp includes both headers under
// nvcc). With COHORT_SEPARATE_COMPILATION the program's cohort library compiles them once
// (cohort/src.cu) and a translation unit sees only this header, so any C++
// compiler compiles the algorithms on a device backend and no trainer TU instantiates a kernel.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

#include "cohort/comm/detail/device_scope.hpp"
#include "cohort/comm/detail/elementwise.hpp"
#include "cohort/comm/detail/exact_squares.hpp"
#include "cohort/config.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0::detail {

namespace device {

// One launcher per kernel: a kernel's dtype is an argument, so these are plain functions.
COHORT_DECL void launch_divide(cudaStream_t stream, void* data, std::size_t count, dtype type, int divisor);
COHORT_DECL void launch_scale(cudaStream_t stream, void* data, std::size_t count, dtype type, double factor);
COHORT_DECL void launch_convert(cudaStream_t stream, const void* in, dtype from, void* out, dtype to, std::size_t count,
                                bool add);
COHORT_DECL void launch_fill(cudaStream_t stream, void* data, std::size_t count, dtype type, double value);
COHORT_DECL void launch_canonical_sum_parts(cudaStream_t stream, const void* parts, std::size_t part_count,
                                            std::size_t count, dtype type, int divisor, void* out);
COHORT_DECL void launch_batched_copy(cudaStream_t stream, std::span<const copy_region> regions);
COHORT_DECL void launch_count_nonfinite(cudaStream_t stream, const void* data, std::size_t count, dtype type,
                                        std::int64_t* result);
COHORT_DECL void launch_sum_of_squares(cudaStream_t stream, const void* data, std::size_t count, dtype type,
                                       double* result);
COHORT_DECL void launch_add_exact_squares(cudaStream_t stream, const void* data, std::size_t count, dtype type,
                                          std::int64_t* words);
// The optimizers' updates compute in T: a kernel per element type. Separately compiled, the
// library instantiates them for float and double (cohort/src.cu).
template <class T>
void launch_sgd(cudaStream_t stream, T* parameters, const T* gradients, T* momentum, std::size_t count,
                const sgd_coefficients& c);
template <class T>
void launch_adam(cudaStream_t stream, T* parameters, const T* gradients, T* first, T* second, std::size_t count,
                 const adam_coefficients& c);

}  // namespace device

template <memory_space Space>
struct elementwise;

template <>
struct elementwise<memory_space::device> {
  template <class B>
  static typename B::work divide(B& engine, void* data, std::size_t count, dtype type, int divisor) {
    const device_scope on_group_device(engine.device());
    device::launch_divide(engine.stream(), data, count, type, divisor);
    return engine.record();
  }

  template <class B>
  static void divide_in_caller_order(B& engine, typename B::stream_type stream, void* data, std::size_t count,
                                     dtype type, int divisor) {
    const device_scope on_group_device(engine.device());
    device::launch_divide(stream, data, count, type, divisor);
  }

  template <class B>
  static typename B::work scale(B& engine, void* data, std::size_t count, dtype type, double factor) {
    const device_scope on_group_device(engine.device());
    device::launch_scale(engine.stream(), data, count, type, factor);
    return engine.record();
  }

  template <class B>
  static typename B::work convert(B& engine, const void* in, dtype from, void* out, dtype to, std::size_t count,
                                  bool add) {
    const device_scope on_group_device(engine.device());
    device::launch_convert(engine.stream(), in, from, out, to, count, add);
    return engine.record();
  }

  template <class B>
  static typename B::work fill(B& engine, void* data, std::size_t count, dtype type, double value) {
    fill_in_caller_order(engine, engine.stream(), data, count, type, value);
    return engine.record();
  }

  template <class B>
  static typename B::work canonical_sum_parts(B& engine, const void* parts, std::size_t part_count, std::size_t count,
                                              dtype type, int divisor, void* out) {
    const device_scope on_group_device(engine.device());
    device::launch_canonical_sum_parts(engine.stream(), parts, part_count, count, type, divisor, out);
    return engine.record();
  }

  template <class B>
  static typename B::work batched_copy(B& engine, std::span<const copy_region> regions) {
    const device_scope on_group_device(engine.device());
    device::launch_batched_copy(engine.stream(), regions);
    return engine.record();
  }

  template <class B>
  static typename B::work count_nonfinite(B& engine, const void* data, std::size_t count, dtype type,
                                          std::int64_t* result) {
    const device_scope on_group_device(engine.device());
    device::launch_count_nonfinite(engine.stream(), data, count, type, result);
    return engine.record();
  }

  template <class B>
  static typename B::work sum_of_squares(B& engine, const void* data, std::size_t count, dtype type, double* result) {
    const device_scope on_group_device(engine.device());
    device::launch_sum_of_squares(engine.stream(), data, count, type, result);
    return engine.record();
  }

  template <class B>
  static typename B::work add_exact_squares(B& engine, const void* data, std::size_t count, dtype type,
                                            std::int64_t* words) {
    const device_scope on_group_device(engine.device());
    device::launch_add_exact_squares(engine.stream(), data, count, type, words);
    return engine.record();
  }

  // The group's order: the caller-order launch below on the group's stream.
  template <class B, class T>
  static typename B::work sgd_step(B& engine, T* parameters, const T* gradients, T* momentum, std::size_t count,
                                   const sgd_coefficients& c) {
    sgd_step_in_caller_order(engine, engine.stream(), parameters, gradients, momentum, count, c);
    return engine.record();
  }

  template <class B, class T>
  static typename B::work adam_step(B& engine, T* parameters, const T* gradients, T* first, T* second,
                                    std::size_t count, const adam_coefficients& c) {
    adam_step_in_caller_order(engine, engine.stream(), parameters, gradients, first, second, count, c);
    return engine.record();
  }

  // The optimizer's work in the caller's order (kernels on the caller's stream), while the
  // group's stream sends what was updated before (training_state's update-then-publish pipeline).
  template <class B>
  static void convert_in_caller_order(B& engine, typename B::stream_type stream, const void* in, dtype from, void* out,
                                      dtype to, std::size_t count) {
    const device_scope on_group_device(engine.device());
    device::launch_convert(stream, in, from, out, to, count, false);
  }
  template <class B>
  static void fill_in_caller_order(B& engine, typename B::stream_type stream, void* data, std::size_t count, dtype type,
                                   double value) {
    const device_scope on_group_device(engine.device());
    device::launch_fill(stream, data, count, type, value);
  }
  template <class B, class T>
  static void sgd_step_in_caller_order(B& engine, typename B::stream_type stream, T* parameters, const T* gradients,
                                       T* momentum, std::size_t count, const sgd_coefficients& c) {
    static_assert(!separately_compiled || std::is_same_v<T, float> || std::is_same_v<T, double>,
                  "cohort: with COHORT_SEPARATE_COMPILATION the library compiles device SGD for float and double");
    const device_scope on_group_device(engine.device());
    device::launch_sgd(stream, parameters, gradients, momentum, count, c);
  }
  template <class B, class T>
  static void adam_step_in_caller_order(B& engine, typename B::stream_type stream, T* parameters, const T* gradients,
                                        T* first, T* second, std::size_t count, const adam_coefficients& c) {
    static_assert(!separately_compiled || std::is_same_v<T, float> || std::is_same_v<T, double>,
                  "cohort: with COHORT_SEPARATE_COMPILATION the library compiles device Adam for float and double");
    const device_scope on_group_device(engine.device());
    device::launch_adam(stream, parameters, gradients, first, second, count, c);
  }

 private:
#if defined(COHORT_SEPARATE_COMPILATION)
  static constexpr bool separately_compiled = true;
#else
  static constexpr bool separately_compiled = false;
#endif
};

}  // namespace cohort::inline v0::detail

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/comm/detail/device_elementwise.cuh"
#endif
