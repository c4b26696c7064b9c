#pragma once
// The global gradient statistics a step decides by, the same on every rank: how many
// gradients are inf or NaN, and their L2 norm, each element counted once. Every strategy that
// updates from averaged gradients (training_state, zero_optimizer) agrees on them this way.

#include <cstdint>
#include <span>

#include "cohort/detail/scalar_math.hpp"
#include "cohort/ops.hpp"
#include "cohort/parallel/optimizer_options.hpp"
#include "cohort/process_group.hpp"

namespace cohort::inline v0::detail {

// `stats` is backend memory for an int64 count and a double sum of squares. `measure_local`
// adds this rank's part to them in the backend's order (count_nonfinite, sum_of_squares);
// with `across_ranks` one grouped all-reduce sums the ranks' parts (sharded gradients), else
// every rank measured the same whole. Fills result.nonfinite and result.grad_norm (NaN when
// any is non-finite; unscaled by result.loss_scale).
template <backend B, class MeasureLocal>
void agree_on_gradient_statistics(process_group<B>& group, void* stats, bool across_ranks, MeasureLocal&& measure_local,
                                  step_result& result) {
  auto& engine = group.backend();
  auto* count = static_cast<std::int64_t*>(stats);
  auto* squares = static_cast<double*>(stats) + 1;
  fill(engine, stats, 2, dtype::int64, 0.0);
  measure_local(count, squares);
  if (across_ranks) {
    auto together = group.grouped();
    group.all_reduce(std::span<std::int64_t>(count, 1), op::sum);
    group.all_reduce(std::span<double>(squares, 1), op::sum);
    together.end();
  }
  std::int64_t found = 0;
  double sum = 0;
  engine.copy(&found, count, sizeof found);
  engine.copy(&sum, squares, sizeof sum).wait();
  result.nonfinite = found;
  result.grad_norm = found > 0 ? quiet_nan() : square_root(sum) / result.loss_scale;
}

}  // namespace cohort::inline v0::detail
