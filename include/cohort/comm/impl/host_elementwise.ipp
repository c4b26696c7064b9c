#pragma once
// cohort/comm/detail/host_elementwise.hpp's loops: inline there when header-only, compiled once by
// <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "cohort/comm/detail/elementwise.hpp"
#include "cohort/comm/detail/host_elementwise.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0::detail::host {

COHORT_DECL void divide(void* data, std::size_t count, dtype type, int divisor) {
  visit_dtype(type, [&](auto sample) {
    using T = decltype(sample);
    T* x = static_cast<T*>(data);
    for (std::size_t i = 0; i < count; ++i) x[i] = divided(x[i], divisor);
  });
}

COHORT_DECL void scale(void* data, std::size_t count, dtype type, double factor) {
  visit_floating(type, [&](auto sample) {
    using T = decltype(sample);
    T* x = static_cast<T*>(data);
    for (std::size_t i = 0; i < count; ++i) x[i] = scaled(x[i], factor);
  });
}

COHORT_DECL void convert(const void* in, dtype from, void* out, dtype to, std::size_t count, bool add) {
  visit_floating(from, [&](auto source) {
    visit_floating(to, [&](auto target) {
      using F = decltype(source);
      using T = decltype(target);
      const F* x = static_cast<const F*>(in);
      T* y = static_cast<T*>(out);
      if (add)
        for (std::size_t i = 0; i < count; ++i) y[i] = added(y[i], converted<T>(x[i]));
      else
        for (std::size_t i = 0; i < count; ++i) y[i] = converted<T>(x[i]);
    });
  });
}

COHORT_DECL void fill(void* data, std::size_t count, dtype type, double value) {
  visit_dtype(type, [&](auto sample) {
    using T = decltype(sample);
    T* x = static_cast<T*>(data);
    const T v = converted_value<T>(value);
    for (std::size_t i = 0; i < count; ++i) x[i] = v;
  });
}

COHORT_DECL void copy_regions(const copy_region* regions, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i)  // empty regions may carry null pointers, which memmove must not see
    if (regions[i].bytes != 0) std::memmove(regions[i].destination, regions[i].source, regions[i].bytes);
}

COHORT_DECL std::int64_t count_nonfinite(const void* data, std::size_t count, dtype type) {
  std::int64_t bad = 0;
  if (!is_floating(type)) return bad;
  visit_floating(type, [&](auto sample) {
    using T = decltype(sample);
    const T* x = static_cast<const T*>(data);
    for (std::size_t i = 0; i < count; ++i) bad += nonfinite(x[i]);
  });
  return bad;
}

COHORT_DECL double sum_of_squares(const void* data, std::size_t count, dtype type) {
  double sum = 0;
  if (!is_floating(type)) return sum;
  visit_floating(type, [&](auto sample) {
    using T = decltype(sample);
    const T* x = static_cast<const T*>(data);
    for (std::size_t i = 0; i < count; ++i) sum += squared(x[i]);
  });
  return sum;
}

}  // namespace cohort::inline v0::detail::host
