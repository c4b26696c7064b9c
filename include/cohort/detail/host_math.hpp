#pragma once
// Element-wise arithmetic on host buffers of any cohort dtype: the reductions Gloo lacks
// (half and bfloat16 go through float) and the small kernels algorithms need on the host
// (scaling, casting, finiteness). The device twins live in backend/nccl_kernels.cuh.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cohort/types.hpp"

namespace cohort::inline v0::detail {

template <class T>
inline constexpr bool is_16bit_float = std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;

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

// data[i] /= divisor (averaging); integers divide with truncation, as NCCL's ncclAvg does.
template <class T>
void divide(T* data, std::size_t n, int divisor) {
  if constexpr (is_16bit_float<T>) {
    const float inverse = 1.0f / static_cast<float>(divisor);
    for (std::size_t i = 0; i < n; ++i) data[i] = T(static_cast<float>(data[i]) * inverse);
  } else if constexpr (std::is_floating_point_v<T>) {
    // Division, not multiplication by the reciprocal, so sum/n is exact where it can be.
    const T d = static_cast<T>(divisor);
    for (std::size_t i = 0; i < n; ++i) data[i] = data[i] / d;
  } else {
    const T d = static_cast<T>(divisor);
    for (std::size_t i = 0; i < n; ++i) data[i] = static_cast<T>(data[i] / d);
  }
}

template <class T>
void scale(T* data, std::size_t n, double factor) {
  if constexpr (is_16bit_float<T>) {
    const float f = static_cast<float>(factor);
    for (std::size_t i = 0; i < n; ++i) data[i] = T(static_cast<float>(data[i]) * f);
  } else {
    for (std::size_t i = 0; i < n; ++i) data[i] = static_cast<T>(static_cast<double>(data[i]) * factor);
  }
}

template <class From, class To>
void cast(const From* in, To* out, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    if constexpr (is_16bit_float<From> || is_16bit_float<To>)
      out[i] = To(static_cast<float>(in[i]));
    else
      out[i] = static_cast<To>(in[i]);
  }
}

template <class T>
std::size_t count_nonfinite(const T* data, std::size_t n) {
  if constexpr (std::is_integral_v<T>) {
    (void)data;
    (void)n;
    return 0;
  } else {
    std::size_t bad = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if constexpr (is_16bit_float<T>)
        bad += !std::isfinite(static_cast<float>(data[i]));
      else
        bad += !std::isfinite(data[i]);
    }
    return bad;
  }
}

}  // namespace cohort::inline v0::detail
