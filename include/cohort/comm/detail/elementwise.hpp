#pragma once
// Per-element formulas of cohort's element-wise work, written once for the host loops
// (comm/detail/host_elementwise.hpp) and the CUDA kernels (comm/detail/device_elementwise.cuh), so
// both compute the same values. 16-bit floats compute in float; other types as themselves
// (scaling goes through double, as a factor is a double).

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cohort/detail/host_device.hpp"
#include "cohort/detail/scalar_math.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0::detail {

template <class T>
inline constexpr bool is_16bit_float = std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;

// x / divisor: averaging. Integers truncate (as ncclAvg does); 16-bit floats multiply by
// the reciprocal in float; float and double divide, so sum / n is exact where it can be.
template <class T>
COHORT_HOST_DEVICE inline T divided(T x, int divisor) {
  if constexpr (is_16bit_float<T>)
    return T(static_cast<float>(x) * (1.0f / static_cast<float>(divisor)));
  else
    return static_cast<T>(x / static_cast<T>(divisor));
}

// x * factor: loss scaling, unscaling.
template <class T>
COHORT_HOST_DEVICE inline T scaled(T x, double factor) {
  if constexpr (is_16bit_float<T>)
    return T(static_cast<float>(x) * static_cast<float>(factor));
  else
    return static_cast<T>(static_cast<double>(x) * factor);
}

// The value `value` as a T (fills).
template <class T>
COHORT_HOST_DEVICE inline T converted_value(double value) {
  if constexpr (is_16bit_float<T>)
    return T(static_cast<float>(value));
  else
    return static_cast<T>(value);
}

// From -> To, through float when either side is a 16-bit float (round to nearest even).
template <class To, class From>
COHORT_HOST_DEVICE inline To converted(From x) {
  if constexpr (is_16bit_float<From> || is_16bit_float<To>)
    return To(static_cast<float>(x));
  else
    return static_cast<To>(x);
}

// a + b in T's own precision (16-bit floats through float).
template <class T>
COHORT_HOST_DEVICE constexpr T added(T a, T b) {
  if constexpr (is_16bit_float<T>)
    return T(static_cast<float>(a) + static_cast<float>(b));
  else
    return static_cast<T>(a + b);
}

// The canonical tree (cohort/parallel/canonical_order.hpp) over value(0) .. value(n - 1), n > 0,
// every node rounded to T as `added` rounds it, as a binary counter, so that one thread holds
// the tree in log2(n) + 1 values instead of n: the device's fused sum of parts and canonical_sum.
template <class T, class Value>
COHORT_HOST_DEVICE constexpr T canonical_tree_sum(std::size_t n, Value&& value) {
  T levels[64];  // bit l of the count so far set: levels[l] holds a full level-l node
  for (std::size_t p = 0; p < n; ++p) {
    T carry = value(p);
    std::size_t level = 0;
    for (; (p >> level) & 1; ++level) carry = added(levels[level], carry);
    levels[level] = carry;
  }
  // The odd ones out, smallest first: what the levels above would add them to.
  std::size_t level = 0;
  while (!((n >> level) & 1)) ++level;
  T sum = levels[level];
  for (++level; level < 64; ++level)
    if ((n >> level) & 1) sum = added(levels[level], sum);
  return sum;
}

template <class T>
COHORT_HOST_DEVICE inline bool nonfinite(T x) {
  if constexpr (std::is_integral_v<T>) {
    return false;
  } else {
    const auto value = [&] {
      if constexpr (is_16bit_float<T>)
        return static_cast<float>(x);
      else
        return x;
    }();
    return !is_finite(value);
  }
}

// x in double (16-bit floats through float).
template <class T>
COHORT_HOST_DEVICE inline double widened(T x) {
  if constexpr (is_16bit_float<T>)
    return static_cast<double>(static_cast<float>(x));
  else
    return static_cast<double>(x);
}

// x * x in double: what a global gradient norm sums.
template <class T>
COHORT_HOST_DEVICE inline double squared(T x) {
  const double value = widened(x);
  return value * value;
}

// Optimizer updates of one element of a shard. grad_scale multiplies the gradient first
// (unscaling a loss scale, clipping by a global norm) without a pass of its own.
struct sgd_coefficients {
  double lr = 0;
  double momentum = 0;
  double weight_decay = 0;
  double grad_scale = 1;
};
template <class T>
COHORT_HOST_DEVICE inline void sgd_update(T& parameter, T gradient, T* momentum, const sgd_coefficients& c) {
  gradient *= static_cast<T>(c.grad_scale);
  T step = gradient + static_cast<T>(c.weight_decay) * parameter;
  if (momentum) {
    *momentum = static_cast<T>(c.momentum) * *momentum + step;
    step = *momentum;
  }
  parameter -= static_cast<T>(c.lr) * step;
}

// Adam with decoupled weight decay (AdamW); bias corrections 1 - beta^t precomputed.
struct adam_coefficients {
  double lr = 0;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;
  double correction1 = 1;
  double correction2 = 1;
  double grad_scale = 1;
};
template <class T>
COHORT_HOST_DEVICE inline void adam_update(T& parameter, T gradient, T& first, T& second, const adam_coefficients& c) {
  gradient *= static_cast<T>(c.grad_scale);
  first = static_cast<T>(c.beta1) * first + static_cast<T>(1 - c.beta1) * gradient;
  second = static_cast<T>(c.beta2) * second + static_cast<T>(1 - c.beta2) * gradient * gradient;
  const T corrected_first = first / static_cast<T>(c.correction1);
  const T corrected_second = second / static_cast<T>(c.correction2);
  parameter -= static_cast<T>(c.lr) * (corrected_first / (square_root(corrected_second) + static_cast<T>(c.eps)) +
                                       static_cast<T>(c.weight_decay) * parameter);
}

}  // namespace cohort::inline v0::detail
