#pragma once
// Element types and reduction operations shared by every backend.
//
// cohort::half and cohort::bfloat16 are 16-bit storage types with the bit layout of CUDA's
// __half and __nv_bfloat16, so one host buffer can be copied to and from the device as is.
// Host arithmetic on them goes through float, rounding to nearest even.

#include <bit>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <string_view>
#include <type_traits>
#include <utility>

#if defined(__CUDACC__) || defined(COHORT_HAS_NCCL)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include "cohort/detail/host_device.hpp"

// The one list of element types. Each row: the dtype's name, its host storage type, the
// name errors print, whether it is floating-point, NCCL's name for it and CUDA's device type.
// The enum, to_string, size_of, dtype_of, visit_dtype and the backends' type tables are all
// generated from it: adding a dtype is one row here (and its arithmetic where it has any).
#define COHORT_DTYPES(X)                                                         \
  X(float32, float, "float", true, ncclFloat32, float)                           \
  X(float64, double, "double", true, ncclFloat64, double)                        \
  X(float16, ::cohort::half, "half", true, ncclFloat16, __half)                  \
  X(bfloat16, ::cohort::bfloat16, "bfloat16", true, ncclBfloat16, __nv_bfloat16) \
  X(int32, std::int32_t, "int32", false, ncclInt32, std::int32_t)                \
  X(int64, std::int64_t, "int64", false, ncclInt64, std::int64_t)                \
  X(uint8, std::uint8_t, "uint8", false, ncclUint8, std::uint8_t)

namespace cohort::inline v0 {

enum class op { sum, avg, min, max, product };

#define COHORT_DTYPE_ENUM(name, host, text, floating, nccl, cuda) name,
enum class dtype { COHORT_DTYPES(COHORT_DTYPE_ENUM) };
#undef COHORT_DTYPE_ENUM

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

namespace detail {
COHORT_HOST_DEVICE inline std::uint32_t float_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
#endif
}
COHORT_HOST_DEVICE inline float bits_float(std::uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
#endif
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

#define COHORT_DTYPE_NAME(name, host, text, floating, nccl, cuda) \
  case dtype::name: return text;
constexpr std::string_view to_string(dtype value) {
  switch (value) { COHORT_DTYPES(COHORT_DTYPE_NAME) }
  return "?";
}
#undef COHORT_DTYPE_NAME

#define COHORT_DTYPE_SIZE(name, host, text, floating, nccl, cuda) \
  case dtype::name: return sizeof(host);
constexpr std::size_t size_of(dtype value) {
  switch (value) { COHORT_DTYPES(COHORT_DTYPE_SIZE) }
  return 0;
}
#undef COHORT_DTYPE_SIZE

// A table, not a switch: the list's entries are in enum order, and a switch would hold
// identical branches (clang-tidy's bugprone-branch-clone).
#define COHORT_DTYPE_FLOATING(name, host, text, floating, nccl, cuda) floating,
inline constexpr bool dtype_is_floating[] = {COHORT_DTYPES(COHORT_DTYPE_FLOATING)};
#undef COHORT_DTYPE_FLOATING
constexpr bool is_floating(dtype value) {
  const auto index = static_cast<std::size_t>(value);
  return index < sizeof(dtype_is_floating) && dtype_is_floating[index];
}

template <class T>
struct dtype_of;
#define COHORT_DTYPE_OF(name, host, text, floating, nccl, cuda) \
  template <>                                                   \
  struct dtype_of<host> {                                       \
    static constexpr dtype value = dtype::name;                 \
  };
COHORT_DTYPES(COHORT_DTYPE_OF)
#undef COHORT_DTYPE_OF
#if defined(__CUDACC__) || defined(COHORT_HAS_NCCL)
// CUDA's own 16-bit types name the same dtypes (same bits).
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

// A contiguous run of cohort elements: a vector, array, span, or anything std::data and
// std::size take (without <ranges>, which costs every including translation unit).
template <class R>
concept contiguous_elements = requires(const R& r) {
  std::data(r);
  std::size(r);
  requires element<std::remove_pointer_t<decltype(std::data(r))>>;
};
template <class R>
using element_type_of = std::remove_cv_t<std::remove_pointer_t<decltype(std::data(std::declval<const R&>()))>>;

// One a collective may write into: std::data of it (as a non-const lvalue) points to
// non-const elements (a std::vector<float>, not a const one nor a std::span<const float>).
template <class R>
concept writable_contiguous_elements = contiguous_elements<R> && requires(R& r) {
  requires !std::is_const_v<std::remove_pointer_t<decltype(std::data(r))>>;
};

// A list of such runs (one per tensor, say): a vector of vectors, of spans, ...
template <class L>
concept list_of_contiguous_elements = !contiguous_elements<L> && requires(const L& list) {
  std::begin(list);
  std::end(list);
  requires contiguous_elements<std::remove_cvref_t<decltype(*std::begin(list))>>;
};

// The visitors' macros name a type (`host{}` cannot be parenthesised), and the floating-only
// visitor's non-floating cases are alike by design.
// NOLINTBEGIN(bugprone-macro-parentheses, bugprone-branch-clone)

// Calls fn with a value of the host storage type of a run-time dtype.
#define COHORT_DTYPE_VISIT(name, host, text, floating, nccl, cuda) \
  case dtype::name: return fn(host{});
template <class Fn>
decltype(auto) visit_dtype(dtype value, Fn&& fn) {
  switch (value) { COHORT_DTYPES(COHORT_DTYPE_VISIT) }
  return fn(float{});
}
#undef COHORT_DTYPE_VISIT

// The same over the floating-point dtypes only, the only ones casts, scaling and finiteness
// have a meaning for (callers check is_floating first): four instantiations, not seven.
#define COHORT_DTYPE_VISIT_FLOATING(name, host, text, floating, nccl, cuda) \
  case dtype::name:                                                         \
    if constexpr (floating) fn(host{});                                     \
    return;
template <class Fn>
void visit_floating(dtype value, Fn&& fn) {
  switch (value) { COHORT_DTYPES(COHORT_DTYPE_VISIT_FLOATING) }
}
#undef COHORT_DTYPE_VISIT_FLOATING
// NOLINTEND(bugprone-macro-parentheses, bugprone-branch-clone)

enum class memory_space { host, device };

// One copy of a batched copy (cohort/comm/ops.hpp).
struct copy_region {
  void* destination;
  const void* source;
  std::size_t bytes;
};

}  // namespace cohort::inline v0
