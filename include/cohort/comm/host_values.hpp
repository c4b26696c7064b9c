#pragma once
// A few host values across ranks: a loss, a norm, a count per rank.
//
//   float mean_loss = cohort::all_reduce_value(pg, loss, cohort::op::avg);
//   auto [sum_loss, tokens] = ... cohort::all_reduce_values(pg, {loss, double(tokens)}) ...
//
// Collective and blocking: every rank calls it with as many values, and gets the reduction
// back (op::avg: the mean; integer averages truncate, as ncclAvg's do: pass a double for a
// fractional mean). On a device backend the values go through the group's cached staging
// memory (copy, all-reduce, copy back on the group's stream, then wait): a few values a step,
// not data.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <span>
#include <type_traits>
#include <vector>

#include "cohort/comm/process_group.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0 {

// Any arithmetic type but bool, or a cohort element (half, bfloat16). Elements travel as
// themselves; other integers as int64 (64-bit unsigned values keep their bits: sums and
// products are exact modulo 2^64, min, max and avg need values below 2^63); long double as
// double.
template <class T>
concept reducible_value = !std::same_as<std::remove_cv_t<T>, bool> && (element<T> || std::is_arithmetic_v<T>);

namespace detail {
template <class T>
using value_wire_t = std::conditional_t<element<T>, std::remove_cv_t<T>,
                                        std::conditional_t<std::is_floating_point_v<T>, double, std::int64_t>>;

template <backend B, class T>
std::vector<T> all_reduce_host_values(process_group<B>& group, const T* values, std::size_t count, op reduce) {
  using W = value_wire_t<T>;
  std::vector<W> wire(count);
  for (std::size_t i = 0; i < count; ++i) wire[i] = static_cast<W>(values[i]);
  if constexpr (B::space == memory_space::host) {
    group.all_reduce(std::span<W>(wire), reduce).wait();
  } else {
    auto& engine = group.backend();
    const std::size_t bytes = count * sizeof(W);
    // The group's cached staging: a failed call leaves it to the group, and the next call's
    // copy is ordered after anything still queued on the same stream.
    auto* staged = static_cast<W*>(group.value_staging(bytes));
    engine.copy(staged, wire.data(), bytes);
    group.all_reduce(std::span<W>(staged, count), reduce);
    engine.copy(wire.data(), staged, bytes).wait();
  }
  std::vector<T> result(count);
  for (std::size_t i = 0; i < count; ++i) result[i] = static_cast<T>(wire[i]);
  return result;
}
}  // namespace detail

// Every rank's `values` (the same count on every rank), rank by rank: a layout check's row,
// a count per rank. Through the group's staging buffer on a device backend, as above.
template <backend B, class T>
  requires(std::same_as<T, std::int64_t> || std::same_as<T, double>)
std::vector<T> all_gather_values(process_group<B>& group, std::span<const T> values) {
  const std::size_t count = values.size(), world = static_cast<std::size_t>(group.world_size());
  std::vector<T> all(count * world);
  if constexpr (B::space == memory_space::host) {
    group.all_gather(values, std::span<T>(all)).wait();
  } else {
    auto& engine = group.backend();
    auto* staged = static_cast<T*>(group.value_staging((world + 1) * count * sizeof(T)));
    engine.copy(staged + world * count, values.data(), count * sizeof(T));
    group.all_gather(std::span<const T>(staged + world * count, count), std::span<T>(staged, world * count));
    engine.copy(all.data(), staged, world * count * sizeof(T)).wait();
  }
  return all;
}

// Rank `root`'s `values` into every rank's (the same count on every rank), in place: an
// order every rank must follow. Through the group's staging buffer on a device backend.
template <backend B, class T>
  requires(std::same_as<T, std::int64_t> || std::same_as<T, double>)
void broadcast_values(process_group<B>& group, std::span<T> values, int root) {
  if constexpr (B::space == memory_space::host) {
    group.broadcast(values, root).wait();
  } else {
    auto& engine = group.backend();
    const std::size_t bytes = values.size() * sizeof(T);
    auto* staged = static_cast<T*>(group.value_staging(bytes));
    engine.copy(staged, values.data(), bytes);
    group.broadcast(std::span<T>(staged, values.size()), root);
    engine.copy(values.data(), staged, bytes).wait();
  }
}

template <backend B, reducible_value T>
T all_reduce_value(process_group<B>& group, T value, op reduce = op::sum) {
  return detail::all_reduce_host_values(group, &value, 1, reduce)[0];
}

// A few values in one collective: all_reduce_values(pg, {loss, accuracy}, op::avg), or any
// contiguous range of them (a std::vector, std::array, span).
template <backend B, reducible_value T>
std::vector<T> all_reduce_values(process_group<B>& group, std::initializer_list<T> values, op reduce = op::sum) {
  return detail::all_reduce_host_values(group, values.begin(), values.size(), reduce);
}
template <backend B, class R>
  requires requires(const R& values) {
    std::data(values);
    std::size(values);
    requires reducible_value<std::remove_pointer_t<decltype(std::data(values))>>;
  }
auto all_reduce_values(process_group<B>& group, const R& values, op reduce = op::sum) {
  return detail::all_reduce_host_values(group, std::data(values), std::size(values), reduce);
}

}  // namespace cohort::inline v0
