#pragma once
// The host system's element-wise work (cohort/comm/ops.hpp): plain loops over the formulas of
// comm/detail/elementwise.hpp, queued as one task on the backend's FIFO worker (enqueue), so
// they run after everything queued on the group before them.
//
// The loops take the dtype at run time and are plain functions (cohort/comm/impl/host_elementwise.ipp),
// as the device system's kernels are: compiled once by a separately compiled program, and
// never instantiated per dtype (pair) in a translation unit that only includes this header.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "cohort/comm/detail/elementwise.hpp"
#include "cohort/comm/detail/exact_squares.hpp"
#include "cohort/config.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0::detail {

namespace host {

COHORT_COLD void divide(void* data, std::size_t count, dtype type, int divisor);
COHORT_COLD void scale(void* data, std::size_t count, dtype type, double factor);
// y = (to) x, or y += (to) x with `add`; floating dtypes.
COHORT_COLD void convert(const void* in, dtype from, void* out, dtype to, std::size_t count, bool add);
COHORT_COLD void fill(void* data, std::size_t count, dtype type, double value);
// out = the canonical tree over `part_count` parts of `count` elements each, laid one after
// the other from `parts`, divided by `divisor` unless it is 0; floating dtypes. out may be
// part 0 itself.
COHORT_COLD void canonical_sum_parts(const void* parts, std::size_t part_count, std::size_t count, dtype type,
                                     int divisor, void* out);
COHORT_COLD void copy_regions(const copy_region* regions, std::size_t count);
// 0 / 0.0 for a dtype that is not floating.
COHORT_COLD std::int64_t count_nonfinite(const void* data, std::size_t count, dtype type);
COHORT_COLD double sum_of_squares(const void* data, std::size_t count, dtype type);
// Adds the exact squares of the elements to `words` (exact_squares.hpp's bins of `type`).
COHORT_COLD void add_exact_squares(const void* data, std::size_t count, dtype type, std::int64_t* words);
// AdamW (detail::adam_update) over `count` elements, on x86 four floats (two doubles) at a
// time: the same operations in the same order for every element as adam_update's.
COHORT_COLD void adam(float* parameters, const float* gradients, float* first, float* second, std::size_t count,
                      const adam_coefficients& c);
COHORT_COLD void adam(double* parameters, const double* gradients, double* first, double* second, std::size_t count,
                      const adam_coefficients& c);

}  // namespace host

template <memory_space Space>
struct elementwise;

template <>
struct elementwise<memory_space::host> {
  template <class B>
  static typename B::work divide(B& engine, void* data, std::size_t count, dtype type, int divisor) {
    return engine.enqueue([=] { host::divide(data, count, type, divisor); });
  }

  // The caller's order on the host is the calling thread: now.
  template <class B>
  static void divide_in_caller_order(B&, typename B::stream_type, void* data, std::size_t count, dtype type,
                                     int divisor) {
    host::divide(data, count, type, divisor);
  }

  template <class B>
  static typename B::work scale(B& engine, void* data, std::size_t count, dtype type, double factor) {
    return engine.enqueue([=] { host::scale(data, count, type, factor); });
  }

  template <class B>
  static typename B::work convert(B& engine, const void* in, dtype from, void* out, dtype to, std::size_t count,
                                  bool add) {
    return engine.enqueue([=] { host::convert(in, from, out, to, count, add); });
  }

  template <class B>
  static typename B::work fill(B& engine, void* data, std::size_t count, dtype type, double value) {
    return engine.enqueue([=] { host::fill(data, count, type, value); });
  }

  template <class B>
  static typename B::work canonical_sum_parts(B& engine, const void* parts, std::size_t part_count, std::size_t count,
                                              dtype type, int divisor, void* out) {
    return engine.enqueue([=] { host::canonical_sum_parts(parts, part_count, count, type, divisor, out); });
  }

  template <class B>
  static typename B::work batched_copy(B& engine, std::span<const copy_region> regions) {
    return engine.enqueue([list = std::vector<copy_region>(regions.begin(), regions.end())] {
      host::copy_regions(list.data(), list.size());
    });
  }

  template <class B>
  static typename B::work count_nonfinite(B& engine, const void* data, std::size_t count, dtype type,
                                          std::int64_t* result) {
    return engine.enqueue([=] { *result += host::count_nonfinite(data, count, type); });
  }

  template <class B>
  static typename B::work sum_of_squares(B& engine, const void* data, std::size_t count, dtype type, double* result) {
    return engine.enqueue([=] { *result += host::sum_of_squares(data, count, type); });
  }

  template <class B>
  static typename B::work add_exact_squares(B& engine, const void* data, std::size_t count, dtype type,
                                            std::int64_t* words) {
    return engine.enqueue([=] { host::add_exact_squares(data, count, type, words); });
  }

  template <class B, class T>
  static typename B::work sgd_step(B& engine, T* parameters, const T* gradients, T* momentum, std::size_t count,
                                   const sgd_coefficients& c) {
    return engine.enqueue([=] {
      for (std::size_t i = 0; i < count; ++i)
        sgd_update(parameters[i], gradients[i], momentum ? momentum + i : nullptr, c);
    });
  }

  template <class B, class T>
  static typename B::work adam_step(B& engine, T* parameters, const T* gradients, T* first, T* second,
                                    std::size_t count, const adam_coefficients& c) {
    return engine.enqueue([=] { host::adam(parameters, gradients, first, second, count, c); });
  }

  // The optimizer's work in the caller's order (the calling thread, now), while the group's
  // worker sends what was updated before (training_state's update-then-publish pipeline).
  template <class B>
  static void convert_in_caller_order(B&, typename B::stream_type, const void* in, dtype from, void* out, dtype to,
                                      std::size_t count) {
    host::convert(in, from, out, to, count, false);
  }
  template <class B>
  static void fill_in_caller_order(B&, typename B::stream_type, void* data, std::size_t count, dtype type,
                                   double value) {
    host::fill(data, count, type, value);
  }
  template <class B, class T>
  static void sgd_step_in_caller_order(B&, typename B::stream_type, T* parameters, const T* gradients, T* momentum,
                                       std::size_t count, const sgd_coefficients& c) {
    for (std::size_t i = 0; i < count; ++i)
      sgd_update(parameters[i], gradients[i], momentum ? momentum + i : nullptr, c);
  }
  template <class B, class T>
  static void adam_step_in_caller_order(B&, typename B::stream_type, T* parameters, const T* gradients, T* first,
                                        T* second, std::size_t count, const adam_coefficients& c) {
    host::adam(parameters, gradients, first, second, count, c);
  }
};

}  // namespace cohort::inline v0::detail

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/comm/impl/host_elementwise.ipp"
#endif
