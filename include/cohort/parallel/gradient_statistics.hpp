#pragma once
// The global gradient statistics a step decides by, the same on every rank: how many
// gradients are inf or NaN, and their L2 norm, each element counted once. Every strategy that
// updates from averaged gradients (training_state) agrees on them this way.

#include <cstdint>
#include <span>

#include "cohort/comm/ops.hpp"
#include "cohort/comm/process_group.hpp"
#include "cohort/detail/scalar_math.hpp"
#include "cohort/parallel/optimizer_options.hpp"

namespace cohort::inline v0::detail {

// `stats` is backend memory for an int64 count and a double sum of squares, which already
// holds this rank's part of the sum of squares (its caller zeroed it at the step's start and
// added each bucket's part, in the backend's order, as its reduction completed);
// `count_nonfinite` adds this rank's count of infs and NaNs. With `across_ranks` all-reduces
// sum the ranks' parts (each rank measured its share of the elements, each element in one
// share), else this rank measured every element (one rank). Fills result.nonfinite and
// result.grad_norm (NaN when any is non-finite; unscaled by result.loss_scale).
//
// One pass in the common case, and that one overlaps the backward: an inf or a NaN makes the
// sum of squares (accumulated in double) non-finite, so the count is only taken, in a second
// pass, when the sum says there is something to count. Every rank sees the same sum, so every
// rank takes the same branch and issues the same collectives. A sum that overflowed with
// finite gradients is counted as one non-finite value: its step would have no meaningful norm
// to clip by either.
template <backend B, class CountNonfinite>
void agree_on_gradient_statistics(process_group<B>& group, void* stats, bool across_ranks,
                                  CountNonfinite&& count_nonfinite, step_result& result) {
  auto& engine = group.backend();
  auto* count = static_cast<std::int64_t*>(stats);
  auto* squares = static_cast<double*>(stats) + 1;
  if (across_ranks) group.all_reduce(std::span<double>(squares, 1), op::sum);
  double sum = 0;
  engine.copy(&sum, squares, sizeof sum).wait();
  if (is_finite(sum)) {
    result.nonfinite = 0;
    result.grad_norm = square_root(sum) / result.loss_scale;
    return;
  }
  fill(engine, count, 1, dtype::int64, 0.0);
  count_nonfinite(count);
  if (across_ranks) group.all_reduce(std::span<std::int64_t>(count, 1), op::sum);
  std::int64_t found = 0;
  engine.copy(&found, count, sizeof found).wait();
  result.nonfinite = found > 0 ? found : 1;
  result.grad_norm = quiet_nan();
}

}  // namespace cohort::inline v0::detail
