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

// A 16-bit float's sum (divisor 1) or average of `parts` contributions (in rank order), each
// element added in float and rounded once: the same bits whichever transport gathered the
// parts, and an average of values near the type's maximum stays finite (as NCCL accumulates
// in float). Reads a block of every part before it writes that block: `out` may be one of
// the parts.
template <class T>
void sum_in_rank_order(void* out, const void* const* parts, std::size_t count, std::size_t n, int divisor) {
  constexpr std::size_t block = 512;
  float sum[block];
  auto* o = static_cast<T*>(out);
  const float scale = 1.0f / static_cast<float>(divisor);
  for (std::size_t first = 0; first < n; first += block) {
    const std::size_t m = std::min(block, n - first);
    const T* part = static_cast<const T*>(parts[0]) + first;
    for (std::size_t i = 0; i < m; ++i) sum[i] = static_cast<float>(part[i]);
    for (std::size_t p = 1; p < count; ++p) {
      part = static_cast<const T*>(parts[p]) + first;
      for (std::size_t i = 0; i < m; ++i) sum[i] += static_cast<float>(part[i]);
    }
    if (divisor > 1)
      for (std::size_t i = 0; i < m; ++i) o[first + i] = T(sum[i] * scale);
    else
      for (std::size_t i = 0; i < m; ++i) o[first + i] = T(sum[i]);
  }
}

using rank_order_sum_fn = void (*)(void*, const void* const*, std::size_t, std::size_t, int);

// sum_in_rank_order for a 16-bit float's sum or average; null for every other reduction.
inline rank_order_sum_fn rank_order_sum_function(dtype type, op value) {
  if (value != op::sum && value != op::avg) return nullptr;
  if (type == dtype::float16) return &sum_in_rank_order<half>;
  if (type == dtype::bfloat16) return &sum_in_rank_order<bfloat16>;
  return nullptr;
}

// data[i] /= divisor, with detail::divided's rules (integers truncate).
template <class T>
void divide(T* data, std::size_t n, int divisor) {
  for (std::size_t i = 0; i < n; ++i) data[i] = divided(data[i], divisor);
}

}  // namespace cohort::inline v0::detail
