#pragma once
// cohort/comm/detail/host_elementwise.hpp's loops: inline there when header-only, compiled once by
// <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cohort/comm/detail/elementwise.hpp"
#include "cohort/comm/detail/exact_squares.hpp"
#include "cohort/comm/detail/host_elementwise.hpp"
#include "cohort/detail/scalar_math.hpp"
#include "cohort/types.hpp"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace cohort::inline v0::detail::host {

COHORT_COLD_BODY void divide(void* data, std::size_t count, dtype type, int divisor) {
  visit_dtype(type, [&](auto sample) {
    using T = decltype(sample);
    T* x = static_cast<T*>(data);
    for (std::size_t i = 0; i < count; ++i) x[i] = divided(x[i], divisor);
  });
}

COHORT_COLD_BODY void scale(void* data, std::size_t count, dtype type, double factor) {
  visit_floating(type, [&](auto sample) {
    using T = decltype(sample);
    T* x = static_cast<T*>(data);
    for (std::size_t i = 0; i < count; ++i) x[i] = scaled(x[i], factor);
  });
}

COHORT_COLD_BODY void convert(const void* in, dtype from, void* out, dtype to, std::size_t count, bool add) {
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

COHORT_COLD_BODY void fill(void* data, std::size_t count, dtype type, double value) {
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
COHORT_COLD_BODY void canonical_sum_parts(const void* parts, std::size_t part_count, std::size_t count, dtype type,
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

COHORT_COLD_BODY void copy_regions(const copy_region* regions, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i)  // empty regions may carry null pointers, which memmove must not see
    if (regions[i].bytes != 0) std::memmove(regions[i].destination, regions[i].source, regions[i].bytes);
}

COHORT_COLD_BODY std::int64_t count_nonfinite(const void* data, std::size_t count, dtype type) {
  std::int64_t bad = 0;
  if (!is_floating(type)) return bad;
  visit_floating(type, [&](auto sample) {
    using T = decltype(sample);
    const T* x = static_cast<const T*>(data);
    for (std::size_t i = 0; i < count; ++i) bad += nonfinite(x[i]);
  });
  return bad;
}

COHORT_COLD_BODY double sum_of_squares(const void* data, std::size_t count, dtype type) {
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

// exact_squares.hpp's sums over float, double or 16-bit values. Each element adds m^2 to a
// running integer of its bin, in `sets` sets of bins taken in turn: neighbours mostly share an
// exponent, and one set would make each add wait for the one before it on the same word. Every
// 2^run_bits elements (the most a running sum holds) the sums are cut into the words' pieces.
template <class T>
void add_exact_squares_of(const T* x, std::size_t count, std::int64_t* words) {
  constexpr auto layout = exact_squares_layout_v<T>;
  constexpr bool wide = layout.square_bits() + exact_squares_layout::run_bits > 64;
  using running = std::conditional_t<wide, unsigned __int128, std::uint64_t>;
  constexpr std::size_t sets = wide ? 2 : 8;
  constexpr auto bins = static_cast<std::size_t>(layout.bins());
  constexpr std::size_t run = std::size_t{1} << exact_squares_layout::run_bits;
  // On the stack (16 KiB for float, 64 KiB for double): this runs per bucket per step, where a
  // heap allocation each time would be one more cost of the reproducible mode.
  std::array<running, sets * bins> sums{};
  const auto add = [&](std::size_t set, T value) {
    const auto term = exact_square_of(value);
    sums[set * bins + term.bin] += static_cast<running>(term.significand) * term.significand;
  };
  const auto flush = [&] {
    for (std::size_t set = 0; set < sets; ++set)
      for (std::size_t bin = 0; bin < bins; ++bin) {
        running& sum = sums[set * bins + bin];
        for (int limb = 0; sum != 0; ++limb, sum >>= exact_squares_layout::limb_bits)
          words[bin * layout.limbs() + limb] += static_cast<std::int64_t>(sum & exact_squares_layout::limb_mask);
      }
  };
  for (std::size_t from = 0; from < count; from += run) {
    const std::size_t to = std::min(count, from + run);
    std::size_t i = from;
    for (; i + sets <= to; i += sets)
      for (std::size_t set = 0; set < sets; ++set) add(set, x[i + set]);
    for (; i < to; ++i) add(0, x[i]);
    flush();
  }
}

}  // namespace

COHORT_COLD_BODY void add_exact_squares(const void* data, std::size_t count, dtype type, std::int64_t* words) {
  if (!is_floating(type)) return;
  visit_floating(type, [&](auto sample) {
    using T = decltype(sample);
    add_exact_squares_of(static_cast<const T*>(data), count, words);
  });
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

COHORT_COLD_BODY void adam(float* parameters, const float* gradients, float* first, float* second, std::size_t count,
                           const adam_coefficients& c) {
  adam_lanes(parameters, gradients, first, second, count, c);
}
COHORT_COLD_BODY void adam(double* parameters, const double* gradients, double* first, double* second,
                           std::size_t count, const adam_coefficients& c) {
  adam_lanes(parameters, gradients, first, second, count, c);
}

}  // namespace cohort::inline v0::detail::host
