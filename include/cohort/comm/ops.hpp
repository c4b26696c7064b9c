#pragma once
// Element-wise work over any backend: what algorithms (training_state, sharded parameters,
// optimizers) call, so each is written once and reads the same on every engine.
//
// Each call runs in the backend's own order, after everything queued on the group before
// it, and returns the work that completes with it: on a host backend (Gloo) a task on the
// group's FIFO worker, on a device backend (NCCL) a kernel on the group's stream.
// divide_in_caller_order runs in the caller's order instead: on a host backend now, on the
// calling thread; on a device backend a kernel on the caller's stream.
//
// Like Thrust's systems, each memory space implements these entry points in its own place:
// comm/detail/host_elementwise.hpp (loops) and comm/detail/device_elementwise.hpp (kernel launches).
// The kernels (comm/detail/device_elementwise.cuh) are compiled by nvcc: in the translation unit
// that uses them on a device backend (a clear static_assert says so when it is not a .cu
// file), or once in the program's cohort library with COHORT_SEPARATE_COMPILATION (see
// cohort/config.hpp). The per-element formulas are shared (comm/detail/elementwise.hpp), so
// both compute the same values.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "cohort/comm/detail/elementwise.hpp"
#include "cohort/comm/process_group.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0 {

namespace detail {

// Each memory space's implementation of the entry points below.
template <memory_space Space>
struct elementwise {
  static_assert(Space == memory_space::host,
                "cohort: device-side element-wise work launches CUDA kernels: compile this translation unit "
                "with nvcc (a .cu file), or link a cohort library that compiled them "
                "(COHORT_SEPARATE_COMPILATION, cohort_add_compiled_library with CUDA enabled)");
};

inline void require_floating(std::string_view operation, dtype type) {
  if (!is_floating(type))
    throw error(-1, operation, detail::text(to_string(type), " is not a floating-point dtype"),
                "this operation is defined for float, double, half and bfloat16");
}

}  // namespace detail
}  // namespace cohort::inline v0

#include "cohort/comm/detail/host_elementwise.hpp"
#if defined(__CUDACC__) || (defined(COHORT_SEPARATE_COMPILATION) && defined(COHORT_HAS_NCCL) && COHORT_HAS_NCCL)
#include "cohort/comm/detail/device_elementwise.hpp"
#endif

namespace cohort::inline v0 {

// data[i] /= divisor (averaging; integers truncate, as ncclAvg does).
template <backend B>
typename B::work divide(B& engine, void* data, std::size_t count, dtype type, int divisor) {
  return detail::elementwise<B::space>::divide(engine, data, count, type, divisor);
}

// The same in the caller's order: right away on the calling thread (host), or a kernel on
// the caller's stream (device), where what the caller just wrote is still hot.
template <backend B>
void divide_in_caller_order(B& engine, typename B::stream_type caller, void* data, std::size_t count, dtype type,
                            int divisor) {
  detail::elementwise<B::space>::divide_in_caller_order(engine, caller, data, count, type, divisor);
}

// data[i] *= factor (loss scaling); floating dtypes.
template <backend B>
typename B::work scale(B& engine, void* data, std::size_t count, dtype type, double factor) {
  detail::require_floating("scale", type);
  return detail::elementwise<B::space>::scale(engine, data, count, type, factor);
}

// out[i] = (to) in[i], element by element (compression, mixed precision); floating dtypes.
template <backend B>
typename B::work cast(B& engine, const void* in, dtype from, void* out, dtype to, std::size_t count) {
  detail::require_floating("cast", from);
  detail::require_floating("cast", to);
  return detail::elementwise<B::space>::convert(engine, in, from, out, to, count, false);
}

// out[i] = (to) in[i], or out[i] += (to) in[i] when `add` (gradient accumulation into a
// master-precision shard); floating dtypes.
template <backend B>
typename B::work accumulate(B& engine, const void* in, dtype from, void* out, dtype to, std::size_t count, bool add) {
  detail::require_floating("accumulate", from);
  detail::require_floating("accumulate", to);
  return detail::elementwise<B::space>::convert(engine, in, from, out, to, count, add);
}

// out[i] = the canonical tree (for_each_canonical_pair's order, cohort/parallel/canonical_order.hpp)
// over parts[0][i] .. parts[part_count - 1][i], every node rounded to the element type as
// accumulate rounds it, then divided by `divisor` unless it is 0: the bits of those
// accumulates and that divide, in one pass over memory (the host works block by block, a
// device thread holds an element's tree in registers). The parts lie one after the other,
// `count` elements each; out may be part 0 itself. Floating dtypes.
template <backend B>
typename B::work canonical_sum_parts(B& engine, const void* parts, std::size_t part_count, std::size_t count,
                                     dtype type, int divisor, void* out) {
  detail::require_floating("canonical_sum_parts", type);
  if (part_count == 0)
    throw error(-1, "canonical_sum_parts", detail::text("no parts to sum (", std::to_string(count), " elements each)"),
                "pass at least one part");
  return detail::elementwise<B::space>::canonical_sum_parts(engine, parts, part_count, count, type, divisor, out);
}

// data[i] = value.
template <backend B>
typename B::work fill(B& engine, void* data, std::size_t count, dtype type, double value) {
  return detail::elementwise<B::space>::fill(engine, data, count, type, value);
}

// Many copies as one operation (one kernel per 64 regions on a device), instead of one
// memcpy call per tensor. Empty regions may carry null pointers.
template <backend B>
typename B::work batched_copy(B& engine, std::span<const copy_region> regions) {
  return detail::elementwise<B::space>::batched_copy(engine, regions);
}

// *result += the number of NaN and Inf elements (0 for integer dtypes); `result` lives in
// the backend's memory.
template <backend B>
typename B::work count_nonfinite(B& engine, const void* data, std::size_t count, dtype type, std::int64_t* result) {
  return detail::elementwise<B::space>::count_nonfinite(engine, data, count, type, result);
}

// *result += the sum of the squared elements, in double (0 for integer dtypes): a global
// gradient norm's local part; `result` lives in the backend's memory.
template <backend B>
typename B::work sum_of_squares(B& engine, const void* data, std::size_t count, dtype type, double* result) {
  return detail::elementwise<B::space>::sum_of_squares(engine, data, count, type, result);
}

// Adds the elements' squares, exactly, to `words` (detail::exact_squares_words(type) int64s in
// the backend's memory, zeroed before the first): integers binned by exponent
// (comm/detail/exact_squares.hpp) whose sums no order or cut changes, which ranks add by an
// all-reduce op::sum and detail::exact_norm turns into a norm (training_options::reproducible).
// An inf or a NaN is counted in a bin of its own; an integer dtype adds nothing.
template <backend B>
typename B::work add_exact_squares(B& engine, const void* data, std::size_t count, dtype type, std::int64_t* words) {
  return detail::elementwise<B::space>::add_exact_squares(engine, data, count, type, words);
}

// One optimizer step over a shard (momentum may be null: plain SGD).
template <backend B, class T>
typename B::work sgd_step(B& engine, T* parameters, const T* gradients, T* momentum, std::size_t count,
                          const detail::sgd_coefficients& coefficients) {
  return detail::elementwise<B::space>::sgd_step(engine, parameters, gradients, momentum, count, coefficients);
}
template <backend B, class T>
typename B::work adam_step(B& engine, T* parameters, const T* gradients, T* first, T* second, std::size_t count,
                           const detail::adam_coefficients& coefficients) {
  return detail::elementwise<B::space>::adam_step(engine, parameters, gradients, first, second, count, coefficients);
}

// The same in the caller's order (as divide_in_caller_order): on the calling thread now
// (host), or kernels on the caller's stream (device). The group's later work waits for them
// only through the backend's wait_for_caller.
template <backend B>
void cast_in_caller_order(B& engine, typename B::stream_type caller, const void* in, dtype from, void* out, dtype to,
                          std::size_t count) {
  detail::require_floating("cast", from);
  detail::require_floating("cast", to);
  detail::elementwise<B::space>::convert_in_caller_order(engine, caller, in, from, out, to, count);
}
template <backend B>
void fill_in_caller_order(B& engine, typename B::stream_type caller, void* data, std::size_t count, dtype type,
                          double value) {
  detail::elementwise<B::space>::fill_in_caller_order(engine, caller, data, count, type, value);
}
template <backend B, class T>
void sgd_step_in_caller_order(B& engine, typename B::stream_type caller, T* parameters, const T* gradients, T* momentum,
                              std::size_t count, const detail::sgd_coefficients& coefficients) {
  detail::elementwise<B::space>::sgd_step_in_caller_order(engine, caller, parameters, gradients, momentum, count,
                                                          coefficients);
}
template <backend B, class T>
void adam_step_in_caller_order(B& engine, typename B::stream_type caller, T* parameters, const T* gradients, T* first,
                               T* second, std::size_t count, const detail::adam_coefficients& coefficients) {
  detail::elementwise<B::space>::adam_step_in_caller_order(engine, caller, parameters, gradients, first, second, count,
                                                           coefficients);
}

}  // namespace cohort::inline v0
