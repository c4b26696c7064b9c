#pragma once
// The reductions Gloo lacks, on host buffers of any cohort dtype: combine functions for
// Gloo's setReduceFunction (half and bfloat16 go through float), and averaging's division.

#include <algorithm>
#include <cstddef>

#include "cohort/comm/detail/elementwise.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0::detail {

template <class T, op Op>
inline T combine(T a, T b) {
  if constexpr (is_16bit_float<T>) {
    return T(combine<float, Op>(static_cast<float>(a), static_cast<float>(b)));
  } else {
    if constexpr (Op == op::sum || Op == op::avg) return static_cast<T>(a + b);
    if constexpr (Op == op::product) return static_cast<T>(a * b);
    if constexpr (Op == op::min) return std::min(a, b);
    if constexpr (Op == op::max) return std::max(a, b);
  }
}

// Signature Gloo's AllreduceOptions::setReduceFunction expects: out = a (op) b, n elements.
template <class T, op Op>
void reduce_into(void* out, const void* a, const void* b, std::size_t n) {
  auto* o = static_cast<T*>(out);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  for (std::size_t i = 0; i < n; ++i) o[i] = combine<T, Op>(x[i], y[i]);
}

using reduce_fn = void (*)(void*, const void*, const void*, std::size_t);

template <class T>
reduce_fn reduce_function(op value) {
  switch (value) {
    case op::sum:
    case op::avg: return &reduce_into<T, op::sum>;
    case op::product: return &reduce_into<T, op::product>;
    case op::min: return &reduce_into<T, op::min>;
    case op::max: return &reduce_into<T, op::max>;
  }
  return nullptr;
}

// The same for a run-time dtype.
inline reduce_fn reduce_function(dtype type, op value) {
  return visit_dtype(type, [&](auto sample) { return reduce_function<decltype(sample)>(value); });
}

// Averaging on Gloo without a pass of its own (cohort/comm/impl/gloo.ipp). Gloo's all-reduce
// is given a rank's buffer as two inputs, which it combines once per element before that
// element is first sent or added to a peer's: that local step (both operands the same memory)
// divides, and adding a peer's part sums, so the contributions are averaged as they are read,
// as NCCL's average pre-multiplies.
template <class T>
void average_step_into(void* out, const void* a, const void* b, std::size_t n, int divisor) {
  if (a != b) return reduce_into<T, op::sum>(out, a, b, n);
  auto* o = static_cast<T*>(out);
  const auto* x = static_cast<const T*>(a);
  for (std::size_t i = 0; i < n; ++i) o[i] = divided(x[i], divisor);
}

// out = (a + b) / divisor: the addition that completes a sum and its average in one pass (a
// reduce-scatter's last, or any of an all-reduce's between two ranks).
template <class T>
void sum_divided_into(void* out, const void* a, const void* b, std::size_t n, int divisor) {
  auto* o = static_cast<T*>(out);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  for (std::size_t i = 0; i < n; ++i) o[i] = divided(combine<T, op::sum>(x[i], y[i]), divisor);
}

using divided_reduce_fn = void (*)(void*, const void*, const void*, std::size_t, int);

// The two above for a run-time dtype.
inline divided_reduce_fn average_step_function(dtype type) {
  return visit_dtype(type, [](auto sample) -> divided_reduce_fn { return &average_step_into<decltype(sample)>; });
}
inline divided_reduce_fn sum_divided_function(dtype type) {
  return visit_dtype(type, [](auto sample) -> divided_reduce_fn { return &sum_divided_into<decltype(sample)>; });
}

// data[i] /= divisor, with detail::divided's rules (integers truncate).
template <class T>
void divide(T* data, std::size_t n, int divisor) {
  for (std::size_t i = 0; i < n; ++i) data[i] = divided(data[i], divisor);
}

}  // namespace cohort::inline v0::detail
