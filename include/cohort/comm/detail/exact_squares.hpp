#pragma once
// The exact sum of squares of training_options::reproducible's norm, one layout for the host
// loops (comm/impl/host_elementwise.ipp), the CUDA kernel (comm/detail/device_elementwise.cuh)
// and the one conversion to a double (parallel/impl/reproducible.ipp).
//
// A finite x = m x 2^(e - bias - fraction_bits), m its significand with the hidden bit (a
// subnormal: e = 0, no hidden bit, scaled as e = 1), so x^2 = m^2 x 2^(2e - ...): an integer
// m^2 at a place its exponent alone fixes. Each element adds m^2 to the bin of its exponent
// field, so the sum needs no common scale (no maximum over the ranks first) and integer adds
// make it the same whatever order and cut add the elements: one pass, per bucket, as each is
// final. The bins are `limbs` int64 words each, word k weighing 2^(limb_bits x k), every word
// added to in pieces below 2^limb_bits: a word overflows after 2^(63 - limb_bits) = 2^39 adds,
// more elements than any gradient has, and the ranks' bins sum by one all-reduce op::sum.
// The all-ones exponent (an inf or a NaN) has a bin of its own that counts them (m taken as 1).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cohort/detail/host_device.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0::detail {

struct exact_squares_layout {
  // The width of a word's pieces: a word takes 2^(63 - limb_bits) of them.
  static constexpr int limb_bits = 24;
  static constexpr std::uint64_t limb_mask = (std::uint64_t{1} << limb_bits) - 1;
  // The most elements one sum may add into a bin before it is split into pieces (the host's
  // running sums of m^2 below 2^(2 x significand) fit their integer for so many).
  static constexpr int run_bits = 16;

  int exponent_bits = 0;
  int fraction_bits = 0;

  COHORT_HOST_DEVICE constexpr int bins() const { return 1 << exponent_bits; }
  COHORT_HOST_DEVICE constexpr int nonfinite_bin() const { return bins() - 1; }
  COHORT_HOST_DEVICE constexpr int bias() const { return (1 << (exponent_bits - 1)) - 1; }
  // m^2 below 2^square_bits; a run's sum below 2^(square_bits + run_bits), cut into limbs.
  COHORT_HOST_DEVICE constexpr int square_bits() const { return 2 * (fraction_bits + 1); }
  COHORT_HOST_DEVICE constexpr int limbs() const { return (square_bits() + run_bits + limb_bits - 1) / limb_bits; }
  COHORT_HOST_DEVICE constexpr int words() const { return bins() * limbs(); }
  // The power of two of bin e's unit, m^2 = 1: 2 (max(e, 1) - bias - fraction_bits).
  COHORT_HOST_DEVICE constexpr int unit_exponent(int bin) const {
    return 2 * ((bin > 0 ? bin : 1) - bias() - fraction_bits);
  }
};

template <class T>
inline constexpr exact_squares_layout exact_squares_layout_v = [] {
  if constexpr (std::is_same_v<T, float>)
    return exact_squares_layout{8, 23};
  else if constexpr (std::is_same_v<T, double>)
    return exact_squares_layout{11, 52};
  else if constexpr (std::is_same_v<T, bfloat16>)
    return exact_squares_layout{8, 7};
  else if constexpr (std::is_same_v<T, half>)
    return exact_squares_layout{5, 10};
  else
    return exact_squares_layout{};  // not floating: no bins
}();

constexpr exact_squares_layout exact_squares_layout_of(dtype type) {
  switch (type) {
    case dtype::float32: return exact_squares_layout_v<float>;
    case dtype::float64: return exact_squares_layout_v<double>;
    case dtype::bfloat16: return exact_squares_layout_v<bfloat16>;
    case dtype::float16: return exact_squares_layout_v<half>;
    default: return {};
  }
}

// The int64 words of a dtype's bins: what a buffer passed to add_exact_squares holds.
constexpr std::size_t exact_squares_words(dtype type) {
  const auto layout = exact_squares_layout_of(type);
  return layout.exponent_bits == 0 ? 0 : static_cast<std::size_t>(layout.words());
}

// x's bits, as an unsigned integer of its width.
template <class T>
COHORT_HOST_DEVICE inline std::uint64_t storage_bits(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return float_bits(x);
  } else if constexpr (std::is_same_v<T, double>) {
#if defined(__CUDA_ARCH__)
    return static_cast<std::uint64_t>(__double_as_longlong(x));
#else
    std::uint64_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    return bits;
#endif
  } else {
    return x.bits;
  }
}

// x's bin and the significand whose square it adds there (1 in the non-finite bin), branch-free.
struct exact_square_term {
  unsigned bin;
  std::uint64_t significand;
};
template <class T>
COHORT_HOST_DEVICE inline exact_square_term exact_square_of(T x) {
  constexpr auto layout = exact_squares_layout_v<T>;
  constexpr std::uint64_t fraction_mask = (std::uint64_t{1} << layout.fraction_bits) - 1;
  constexpr unsigned exponent_mask = (1u << layout.exponent_bits) - 1;
  const std::uint64_t bits = storage_bits(x);
  const auto bin = static_cast<unsigned>(bits >> layout.fraction_bits) & exponent_mask;
  const std::uint64_t significand = (bits & fraction_mask) | (std::uint64_t{bin != 0} << layout.fraction_bits);
  return {bin, bin == exponent_mask ? std::uint64_t{1} : significand};
}

}  // namespace cohort::inline v0::detail
