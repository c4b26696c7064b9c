#pragma once
// The <cmath> functions cohort's headers use, as the compiler's builtins. <cmath> costs
// a translation unit about as much to parse as a tenth of twenty standard headers (GCC 12,
// C++20: its special functions), and the headers need only these. On the host the builtins
// are the same libm calls or instructions std:: gives; device code (nvcc) uses CUDA's own.

#include "cohort/detail/host_device.hpp"

namespace cohort::inline v0::detail {

// T: float or double.
template <class T>
COHORT_HOST_DEVICE inline T square_root(T x) {
#if defined(__CUDA_ARCH__)
  return sqrt(x);  // CUDA's float and double overloads
#else
  if constexpr (sizeof(T) == sizeof(float))
    return __builtin_sqrtf(x);
  else
    return __builtin_sqrt(x);
#endif
}

template <class T>
COHORT_HOST_DEVICE inline bool is_finite(T x) {
#if defined(__CUDA_ARCH__)
  return isfinite(x);
#else
  return __builtin_isfinite(x);  // type-generic
#endif
}

// T: float or double (host code).
template <class T>
inline T absolute(T x) {
  if constexpr (sizeof(T) == sizeof(float))
    return __builtin_fabsf(x);
  else
    return __builtin_fabs(x);
}

inline double round_down(double x) { return __builtin_floor(x); }

inline double power(double base, double exponent) { return __builtin_pow(base, exponent); }

// x * 2^exponent, exact unless it overflows or underflows (std::ldexp).
inline double times_power_of_two(double x, int exponent) { return __builtin_ldexp(x, exponent); }

inline double quiet_nan() { return __builtin_nan(""); }

COHORT_HOST_DEVICE inline double infinity() {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(0x7ff0000000000000LL);
#else
  return __builtin_huge_val();
#endif
}

}  // namespace cohort::inline v0::detail
