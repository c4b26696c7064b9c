#pragma once
// The host system's element-wise work (cohort/ops.hpp): plain loops over the formulas of
// detail/elementwise.hpp, queued as one task on the backend's FIFO worker (enqueue), so
// they run after everything queued on the group before them.

#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "cohort/detail/elementwise.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0::detail {

template <memory_space Space>
struct elementwise;

template <>
struct elementwise<memory_space::host> {
  static void divide_now(void* data, std::size_t count, dtype type, int divisor) {
    visit_dtype(type, [&](auto sample) {
      using T = decltype(sample);
      T* x = static_cast<T*>(data);
      for (std::size_t i = 0; i < count; ++i) x[i] = divided(x[i], divisor);
    });
  }

  template <class B>
  static typename B::work divide(B& engine, void* data, std::size_t count, dtype type, int divisor) {
    return engine.enqueue([=] { divide_now(data, count, type, divisor); });
  }

  // The caller's order on the host is the calling thread: now.
  template <class B>
  static void divide_in_caller_order(B&, typename B::stream_type, void* data, std::size_t count, dtype type,
                                     int divisor) {
    divide_now(data, count, type, divisor);
  }

  template <class B>
  static typename B::work scale(B& engine, void* data, std::size_t count, dtype type, double factor) {
    return engine.enqueue([=] {
      visit_floating(type, [&](auto sample) {
        using T = decltype(sample);
        T* x = static_cast<T*>(data);
        for (std::size_t i = 0; i < count; ++i) x[i] = scaled(x[i], factor);
      });
    });
  }

  template <class B>
  static typename B::work convert(B& engine, const void* in, dtype from, void* out, dtype to, std::size_t count,
                                  bool add) {
    return engine.enqueue([=] {
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
    });
  }

  template <class B>
  static typename B::work fill(B& engine, void* data, std::size_t count, dtype type, double value) {
    return engine.enqueue([=] {
      visit_dtype(type, [&](auto sample) {
        using T = decltype(sample);
        T* x = static_cast<T*>(data);
        const T v = converted_value<T>(value);
        for (std::size_t i = 0; i < count; ++i) x[i] = v;
      });
    });
  }

  template <class B>
  static typename B::work batched_copy(B& engine, std::span<const copy_region> regions) {
    return engine.enqueue([list = std::vector<copy_region>(regions.begin(), regions.end())] {
      for (const auto& region : list)  // empty regions may carry null pointers, which memmove must not see
        if (region.bytes != 0) std::memmove(region.destination, region.source, region.bytes);
    });
  }

  template <class B>
  static typename B::work count_nonfinite(B& engine, const void* data, std::size_t count, dtype type,
                                          std::int64_t* result) {
    return engine.enqueue([=] {
      if (!is_floating(type)) return;
      visit_floating(type, [&](auto sample) {
        using T = decltype(sample);
        const T* x = static_cast<const T*>(data);
        std::int64_t bad = 0;
        for (std::size_t i = 0; i < count; ++i) bad += nonfinite(x[i]);
        *result += bad;
      });
    });
  }

  template <class B>
  static typename B::work sum_of_squares(B& engine, const void* data, std::size_t count, dtype type, double* result) {
    return engine.enqueue([=] {
      if (!is_floating(type)) return;
      visit_floating(type, [&](auto sample) {
        using T = decltype(sample);
        const T* x = static_cast<const T*>(data);
        double sum = 0;
        for (std::size_t i = 0; i < count; ++i) sum += squared(x[i]);
        *result += sum;
      });
    });
  }

  template <class B, class T>
  static typename B::work sgd_step(B& engine, T* parameters, const T* gradients, T* momentum, std::size_t count,
                                   const sgd_coefficients& c) {
    return engine.enqueue([=] {
      for (std::size_t i = 0; i < count; ++i)
        sgd_update(parameters[i], gradients[i], momentum ? momentum + i : nullptr, c);
    });
  }

  template <class B, class T>
  static typename B::work adam_step(B& engine, T* parameters, const T* gradients, T* first, T* second,
                                    std::size_t count, const adam_coefficients& c) {
    return engine.enqueue([=] {
      for (std::size_t i = 0; i < count; ++i) adam_update(parameters[i], gradients[i], first[i], second[i], c);
    });
  }
};

}  // namespace cohort::inline v0::detail
