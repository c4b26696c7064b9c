#pragma once
// Element types and reduction operations shared by every backend.
//
// cohort::half and cohort::bfloat16 are 16-bit storage types with the bit layout of CUDA's
// __half and __nv_bfloat16, so one host buffer can be copied to and from the device as is.
// Host arithmetic on them goes through float, rounding to nearest even.

#include <bit>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <type_traits>

#if defined(__CUDACC__) || defined(COHORT_HAS_NCCL)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define COHORT_HAS_CUDA_TYPES 1
#endif

#include "cohort/detail/host_device.hpp"

namespace cohort::inline v0 {

enum class op { sum, avg, min, max, product };

enum class dtype { float32, float64, float16, bfloat16, int32, int64, uint8 };

constexpr std::string_view to_string(op value) {
  switch (value) {
    case op::sum: return "sum";
    case op::avg: return "avg";
    case op::min: return "min";
    case op::max: return "max";
    case op::product: return "prod";
  }
  return "?";
}

constexpr std::string_view to_string(dtype value) {
  switch (value) {
    case dtype::float32: return "float";
    case dtype::float64: return "double";
    case dtype::float16: return "half";
    case dtype::bfloat16: return "bfloat16";
    case dtype::int32: return "int32";
    case dtype::int64: return "int64";
    case dtype::uint8: return "uint8";
  }
  return "?";
}

constexpr std::size_t size_of(dtype value) {
  switch (value) {
    case dtype::float64:
    case dtype::int64: return 8;
    case dtype::float32:
    case dtype::int32: return 4;
    case dtype::float16:
    case dtype::bfloat16: return 2;
    case dtype::uint8: return 1;
  }
  return 0;
}

namespace detail {
COHORT_HOST_DEVICE inline std::uint32_t float_bits(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}
COHORT_HOST_DEVICE inline float bits_float(std::uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}
}  // namespace detail

struct bfloat16 {
  std::uint16_t bits = 0;

  bfloat16() = default;
  COHORT_HOST_DEVICE explicit bfloat16(float value) {
    const std::uint32_t f = detail::float_bits(value);
    if ((f & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a quiet NaN
      bits = static_cast<std::uint16_t>((f >> 16) | 0x40u);
    } else {  // round to nearest, ties to even
      bits = static_cast<std::uint16_t>((f + 0x7fffu + ((f >> 16) & 1u)) >> 16);
    }
  }
  COHORT_HOST_DEVICE explicit operator float() const {
    return detail::bits_float(static_cast<std::uint32_t>(bits) << 16);
  }
  friend bool operator==(bfloat16 a, bfloat16 b) { return a.bits == b.bits; }
};

struct half {
  std::uint16_t bits = 0;

  half() = default;
  COHORT_HOST_DEVICE explicit half(float value) {
    const std::uint32_t f = detail::float_bits(value);
    const std::uint32_t sign = (f >> 16) & 0x8000u;
    const std::uint32_t abs = f & 0x7fffffffu;
    if (abs > 0x7f800000u) {
      bits = static_cast<std::uint16_t>(sign | 0x7e00u);
    } else if (abs >= 0x477ff000u) {  // rounds to >= 65520: infinity
      bits = static_cast<std::uint16_t>(sign | 0x7c00u);
    } else if (abs < 0x38800000u) {  // subnormal half (or zero)
      // Align to the half subnormal grid (2^-24) by adding and removing a large float.
      const float magnitude = detail::bits_float(abs) + 0.5f;
      bits = static_cast<std::uint16_t>(sign | (detail::float_bits(magnitude) - 0x3f000000u));
    } else {
      const std::uint32_t mant_odd = (abs >> 13) & 1u;
      const std::uint32_t rounded = abs + 0xc8000fffu + mant_odd;  // rebias 127->15, round
      bits = static_cast<std::uint16_t>(sign | (rounded >> 13));
    }
  }
  COHORT_HOST_DEVICE explicit operator float() const {
    const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
    const std::uint32_t exponent = (bits >> 10) & 0x1fu;
    const std::uint32_t mantissa = bits & 0x3ffu;
    if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
      const float value = static_cast<float>(mantissa) * 5.9604644775390625e-08f;
      return sign ? -value : value;
    }
    if (exponent == 31) return detail::bits_float(sign | 0x7f800000u | (mantissa << 13));
    return detail::bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  }
  friend bool operator==(half a, half b) { return a.bits == b.bits; }
};

template <class T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr dtype value = dtype::float32;
};
template <>
struct dtype_of<double> {
  static constexpr dtype value = dtype::float64;
};
template <>
struct dtype_of<half> {
  static constexpr dtype value = dtype::float16;
};
template <>
struct dtype_of<bfloat16> {
  static constexpr dtype value = dtype::bfloat16;
};
template <>
struct dtype_of<std::int32_t> {
  static constexpr dtype value = dtype::int32;
};
template <>
struct dtype_of<std::int64_t> {
  static constexpr dtype value = dtype::int64;
};
template <>
struct dtype_of<std::uint8_t> {
  static constexpr dtype value = dtype::uint8;
};
#if defined(COHORT_HAS_CUDA_TYPES)
template <>
struct dtype_of<__half> {
  static constexpr dtype value = dtype::float16;
};
template <>
struct dtype_of<__nv_bfloat16> {
  static constexpr dtype value = dtype::bfloat16;
};
#endif

// The element types every collective accepts (cv-qualifiers ignored).
template <class T>
concept element = requires {
  dtype_of<std::remove_cv_t<T>>::value;
};

template <class T>
inline constexpr dtype dtype_v = dtype_of<std::remove_cv_t<T>>::value;

// Storage type of the host representation of a dtype, for host-side arithmetic.
template <dtype D>
struct storage_of;
template <>
struct storage_of<dtype::float32> {
  using type = float;
};
template <>
struct storage_of<dtype::float64> {
  using type = double;
};
template <>
struct storage_of<dtype::float16> {
  using type = half;
};
template <>
struct storage_of<dtype::bfloat16> {
  using type = bfloat16;
};
template <>
struct storage_of<dtype::int32> {
  using type = std::int32_t;
};
template <>
struct storage_of<dtype::int64> {
  using type = std::int64_t;
};
template <>
struct storage_of<dtype::uint8> {
  using type = std::uint8_t;
};

// Calls fn with a value of the host storage type for a run-time dtype.
template <class Fn>
decltype(auto) visit_dtype(dtype value, Fn&& fn) {
  switch (value) {
    case dtype::float32: return fn(float{});
    case dtype::float64: return fn(double{});
    case dtype::float16: return fn(half{});
    case dtype::bfloat16: return fn(bfloat16{});
    case dtype::int32: return fn(std::int32_t{});
    case dtype::int64: return fn(std::int64_t{});
    case dtype::uint8: return fn(std::uint8_t{});
  }
  return fn(float{});
}

enum class memory_space { host, device };

// One copy of a batched copy (cohort/ops.hpp).
struct copy_region {
  void* destination;
  const void* source;
  std::size_t bytes;
};

}  // namespace cohort::inline v0
