#pragma once
// The one order of addition behind reproducible training (training_options::reproducible):
// n values numbered 0 .. n-1 (a step's micro-batch gradients, the losses of its micro-batches,
// the partial sums of ranks that each hold a run of them) are added pairwise, level by level:
// at stride 1, 2, 4, ... value i takes in value i + stride for every i that is a multiple of
// 2 x stride, an odd one out waiting for a later level. The result depends on n only, never
// on who adds: a run of 2^j consecutive values starting at a multiple of 2^j is one node of
// the tree, so a rank holding such a run sums it alone (for example as a binary counter, one
// value at a time) and the partial sums of consecutive runs continue the same tree. That is
// why N ranks, each with M / N micro-batches (a power of two, or N = 1), give the bits of one
// rank with all M.

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cohort/comm/detail/elementwise.hpp"
#include "cohort/comm/host_values.hpp"
#include "cohort/comm/process_group.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"

namespace cohort::inline v0 {

// Calls add(into, from) for every addition of the canonical tree over n values, in an order
// where each value is complete before it is read: value `into` becomes into + from. Value 0
// holds the sum at the end.
template <class Add>
constexpr void for_each_canonical_pair(std::size_t n, Add&& add) {
  for (std::size_t stride = 1; stride < n; stride *= 2)
    for (std::size_t into = 0; into + stride < n; into += 2 * stride) add(into, into + stride);
}

// The sum of `values` in the canonical order (host scalars: a step's losses, say), by the one
// binary counter the device's fused sum of parts runs too. Empty: 0.
template <class T>
constexpr T canonical_sum(std::span<const T> values) {
  if (values.empty()) return T{};
  return detail::canonical_tree_sum<T>(values.size(), [&](std::size_t i) { return values[i]; });
}

// The mean of values spread over the ranks in one global order, rank 0's first, then rank 1's,
// ... (a step's micro-batch losses, each rank holding its contiguous run of the micro-batches):
// all-gathered, added as canonical_sum adds and divided by their count, on every rank. The
// same bits on every rank and at every world size that holds the same sequence, where an
// all-reduce's sum depends on the world and the ring. Every rank passes as many values: the
// counts are compared first, so a rank that passes another count fails on every rank, named,
// instead of its values pairing with the others'. Collective and blocking: two small
// all-gathers.
template <backend B, class T>
  requires(std::same_as<T, float> || std::same_as<T, double>)
T canonical_mean(process_group<B>& group, std::span<const T> values) {
  const auto count = static_cast<std::int64_t>(values.size());
  const std::vector<std::int64_t> counts = all_gather_values(group, std::span<const std::int64_t>(&count, 1));
  if (std::any_of(counts.begin(), counts.end(), [&](std::int64_t c) { return c != count; })) {
    std::string passed;
    for (std::size_t r = 0; r < counts.size(); ++r)
      passed += detail::text(r ? ", rank " : "rank ", std::to_string(r), ": ", std::to_string(counts[r]));
    throw error(group.rank(), "canonical_mean",
                detail::text("the ranks passed different counts of values (", passed, ")"),
                "every rank passes as many values (reproducible training: the losses of its M / world micro-batches)");
  }
  const std::vector<double> wire(values.begin(), values.end());  // exact: every T is a double
  const std::vector<double> gathered = all_gather_values(group, std::span<const double>(wire));
  if (gathered.empty()) return T{};
  const std::vector<T> ordered(gathered.begin(), gathered.end());
  return canonical_sum(std::span<const T>(ordered)) / static_cast<T>(ordered.size());
}

}  // namespace cohort::inline v0
