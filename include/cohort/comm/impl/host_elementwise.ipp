#pragma once
// cohort/comm/detail/host_elementwise.hpp's loops: inline there when header-only, compiled once by
// <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cohort/comm/detail/elementwise.hpp"
#include "cohort/comm/detail/host_elementwise.hpp"
#include "cohort/detail/scalar_math.hpp"
#include "cohort/types.hpp"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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

// Block by block, so that each part is read once and the output written once, where a pass
// per addition reads and writes the whole sum n times: within a block, canonical_tree_sum's
// counter a level at a time (each addition a loop over the block, which vectorises), part 0
// and every even part read in place rather than copied.
COHORT_DECL void canonical_sum_parts(const void* parts, std::size_t part_count, std::size_t count, dtype type,
                                     int divisor, void* out) {
  visit_floating(type, [&](auto sample) {
    using T = decltype(sample);
    constexpr std::size_t block = 2048;
    const T* x = static_cast<const T*>(parts);
    T* y = static_cast<T*>(out);
    const auto levels = static_cast<std::size_t>(std::bit_width(part_count));
    std::vector<T> computed(levels * std::min(block, count));
    const T* node[64] = {};  // bit l of the parts counted so far set: node[l] is a full level-l node
    for (std::size_t start = 0; start < count; start += block) {
      const std::size_t width = std::min(block, count - start);
      for (std::size_t p = 0; p < part_count; ++p) {
        const T* value = x + p * count + start;
        const auto level = static_cast<std::size_t>(std::countr_one(p));
        if (level == 0) {
          node[0] = value;
          continue;
        }
        T* carry = computed.data() + level * width;
        for (std::size_t j = 0; j < width; ++j) carry[j] = added(node[0][j], value[j]);
        for (std::size_t l = 1; l < level; ++l)
          for (std::size_t j = 0; j < width; ++j) carry[j] = added(node[l][j], carry[j]);
        node[level] = carry;
      }
      // The odd ones out, smallest first (canonical_tree_sum's last loop), into level 0's slot,
      // which no carry uses; then the divide and the store.
      const auto lowest = static_cast<std::size_t>(std::countr_zero(part_count));
      const T* sum = node[lowest];
      for (std::size_t l = lowest + 1; l < levels; ++l) {
        if (!((part_count >> l) & 1)) continue;
        T* const total = computed.data();
        for (std::size_t j = 0; j < width; ++j) total[j] = added(node[l][j], sum[j]);
        sum = total;
      }
      if (divisor != 0)
        for (std::size_t j = 0; j < width; ++j) y[start + j] = divided(sum[j], divisor);
      else if (sum != y + start)  // one part, out on it: already in place
        std::copy(sum, sum + width, y + start);
    }
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
  if (!is_floating(type)) return 0;
  // Four sums side by side: one would wait for each addition before the next (a chain of
  // double additions, four times slower than the loads it follows).
  double sums[4] = {0, 0, 0, 0};
  visit_floating(type, [&](auto sample) {
    using T = decltype(sample);
    const T* x = static_cast<const T*>(data);
    std::size_t i = 0;
    for (; i + 4 <= count; i += 4)
      for (std::size_t lane = 0; lane < 4; ++lane) sums[lane] += squared(x[i + lane]);
    for (; i < count; ++i) sums[0] += squared(x[i]);
  });
  return (sums[0] + sums[1]) + (sums[2] + sums[3]);
}

namespace {

// magnitude()'s maximum over float or double values, taken in T in eight lanes side by side
// (which the compiler vectorises, where one running maximum waits for each comparison before
// the next): |x| widens exactly and a maximum is the same in any order, so the bits are the
// one-by-one loop's. An inf or a NaN anywhere makes it inf, as magnitude() has it.
template <class T>
double largest_magnitude(const T* x, std::size_t count) {
  constexpr std::size_t width = 8;
  constexpr T largest_finite = std::numeric_limits<T>::max();
  T largest[width] = {};
  bool nonfinite[width] = {};
  const auto take = [&](std::size_t lane, T value) {
    const T m = absolute(value);
    largest[lane] = largest[lane] < m ? m : largest[lane];
    nonfinite[lane] |= !(m <= largest_finite);
  };
  std::size_t i = 0;
  for (; i + width <= count; i += width)
    for (std::size_t lane = 0; lane < width; ++lane) take(lane, x[i + lane]);
  for (; i < count; ++i) take(0, x[i]);
  T found = 0;
  for (std::size_t lane = 0; lane < width; ++lane) {
    if (nonfinite[lane]) return infinity();
    found = found < largest[lane] ? largest[lane] : found;
  }
  return static_cast<double>(found);
}

// fixed_point_square's sums. The bound is the division, one a value in scalar code: with SSE2
// two float or double values share one, their squares then made integers one by one as
// fixed_point_square makes them (the same division, product and rounding).
template <class T>
void add_fixed_point_squares(const T* x, std::size_t count, double max, std::uint64_t& high, std::uint64_t& low) {
  const auto add = [&](std::uint64_t square) {
    high += square >> 32;
    low += square & 0xffffffffu;
  };
  std::size_t i = 0;
#if defined(__SSE2__)
  const __m128d divisor = _mm_set1_pd(max);
  const auto add_pair = [&](__m128d values) {
    const __m128d ratio = _mm_div_pd(values, divisor);
    double squares[2];
    _mm_storeu_pd(squares, _mm_mul_pd(ratio, ratio));
    add(fixed_point(squares[0]));
    add(fixed_point(squares[1]));
  };
  if constexpr (std::is_same_v<T, float>) {
    for (; i + 4 <= count; i += 4) {
      const __m128 four = _mm_loadu_ps(x + i);
      add_pair(_mm_cvtps_pd(four));
      add_pair(_mm_cvtps_pd(_mm_movehl_ps(four, four)));
    }
  } else if constexpr (std::is_same_v<T, double>) {
    for (; i + 2 <= count; i += 2) add_pair(_mm_loadu_pd(x + i));
  }
#endif
  for (; i < count; ++i) add(fixed_point_square(x[i], max));
}

}  // namespace

COHORT_DECL double max_magnitude(const void* data, std::size_t count, dtype type) {
  double found = 0;
  if (!is_floating(type)) return found;
  visit_floating(type, [&](auto sample) {
    using T = decltype(sample);
    const T* x = static_cast<const T*>(data);
    if constexpr (is_16bit_float<T>) {
      for (std::size_t i = 0; i < count; ++i) {
        const double m = magnitude(x[i]);
        if (m > found) found = m;
      }
    } else {
      found = largest_magnitude(x, count);
    }
  });
  return found;
}

COHORT_DECL void fixed_point_squares(const void* data, std::size_t count, dtype type, double max,
                                     std::uint64_t* high_low) {
  if (!is_floating(type) || !(max > 0)) return;
  std::uint64_t high = 0, low = 0;
  visit_floating(type, [&](auto sample) {
    using T = decltype(sample);
    add_fixed_point_squares(static_cast<const T*>(data), count, max, high, low);
  });
  high_low[0] += high;
  high_low[1] += low;
}

namespace {

#if defined(__SSE2__)
// A 16-byte vector of T, for adam(): GCC and Clang do not vectorise the scalar loop, since
// its square root may set errno (it never does here: its argument is a sum of squares).
template <class T>
struct lanes;
template <>
struct lanes<float> {
  using vector = __m128;
  static constexpr std::size_t width = 4;
  static vector load(const float* p) { return _mm_loadu_ps(p); }
  static void store(float* p, vector v) { _mm_storeu_ps(p, v); }
  static vector root(vector v) { return _mm_sqrt_ps(v); }
};
template <>
struct lanes<double> {
  using vector = __m128d;
  static constexpr std::size_t width = 2;
  static vector load(const double* p) { return _mm_loadu_pd(p); }
  static void store(double* p, vector v) { _mm_storeu_pd(p, v); }
  static vector root(vector v) { return _mm_sqrt_pd(v); }
};

// adam_update's arithmetic on whole vectors, step for step; the last few elements go through
// a vector of their own, so that every element meets the same instructions wherever it sits.
template <class T>
void adam_lanes(T* parameters, const T* gradients, T* first, T* second, std::size_t count, const adam_coefficients& c) {
  using L = lanes<T>;
  using vector = typename L::vector;
  const T scale = static_cast<T>(c.grad_scale), beta1 = static_cast<T>(c.beta1), rest1 = static_cast<T>(1 - c.beta1),
          beta2 = static_cast<T>(c.beta2), rest2 = static_cast<T>(1 - c.beta2),
          correction1 = static_cast<T>(c.correction1), correction2 = static_cast<T>(c.correction2),
          lr = static_cast<T>(c.lr), eps = static_cast<T>(c.eps), decay = static_cast<T>(c.weight_decay);
  const auto update = [&](T* p, const T* g, T* m, T* v) {
    vector gradient = L::load(g);
    gradient *= scale;
    const vector m1 = beta1 * L::load(m) + rest1 * gradient;
    const vector v1 = beta2 * L::load(v) + rest2 * gradient * gradient;
    L::store(m, m1);
    L::store(v, v1);
    vector parameter = L::load(p);
    parameter -= lr * ((m1 / correction1) / (L::root(v1 / correction2) + eps) + decay * parameter);
    L::store(p, parameter);
  };
  std::size_t i = 0;
  for (; i + L::width <= count; i += L::width) update(parameters + i, gradients + i, first + i, second + i);
  if (i == count) return;
  T p[L::width] = {}, g[L::width] = {}, m[L::width] = {}, v[L::width] = {};
  const std::size_t left = count - i;
  std::memcpy(p, parameters + i, left * sizeof(T));
  std::memcpy(g, gradients + i, left * sizeof(T));
  std::memcpy(m, first + i, left * sizeof(T));
  std::memcpy(v, second + i, left * sizeof(T));
  update(p, g, m, v);
  std::memcpy(parameters + i, p, left * sizeof(T));
  std::memcpy(first + i, m, left * sizeof(T));
  std::memcpy(second + i, v, left * sizeof(T));
}
#else
template <class T>
void adam_lanes(T* parameters, const T* gradients, T* first, T* second, std::size_t count, const adam_coefficients& c) {
  for (std::size_t i = 0; i < count; ++i) adam_update(parameters[i], gradients[i], first[i], second[i], c);
}
#endif

}  // namespace

COHORT_DECL void adam(float* parameters, const float* gradients, float* first, float* second, std::size_t count,
                      const adam_coefficients& c) {
  adam_lanes(parameters, gradients, first, second, count, c);
}
COHORT_DECL void adam(double* parameters, const double* gradients, double* first, double* second, std::size_t count,
                      const adam_coefficients& c) {
  adam_lanes(parameters, gradients, first, second, count, c);
}

}  // namespace cohort::inline v0::detail::host
