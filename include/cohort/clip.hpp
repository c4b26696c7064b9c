#pragma once
// The global gradient norm, and clipping by it, for data parallelism and sharded parameters
// (training_state does both inside its step()).
//
//   ddp.finish();
//   const auto clipped = cohort::clip_grad_norm(ddp, 1.0);        // every rank: same norm
//   ...
//   const double norm = cohort::global_grad_norm(params);          // sharded: shards summed
//   opt.step(norm > 1.0 ? 1.0 / (norm + 1e-6) : 1.0);              // or clip through step
//
// The norm is the L2 norm of the whole model's averaged gradient, the same on every rank:
// after a reducer's finish() every rank holds all of it (replicated: no communication);
// sharded parameters hold one shard per rank, summed with one all-reduce of a double, with
// replicated units counted once (by rank 0). A NaN or an infinity makes the norm NaN; a
// reducer with check_nonfinite says so before (reduction_summary::nonfinite, the same on
// every rank), which is what a loss_scaler::update takes. Each call reads one number back
// to the host: on a device backend it waits for the gradients.

#include <cstdint>
#include <functional>
#include <span>

#include "cohort/detail/scalar_math.hpp"
#include "cohort/ops.hpp"
#include "cohort/parallel/optimizer_options.hpp"
#include "cohort/reducer.hpp"
#include "cohort/sharded.hpp"

namespace cohort::inline v0 {

// The same names as step_result's (cohort/parallel/optimizer_options.hpp).
struct clip_result {
  double grad_norm = 0;    // before clipping
  double clip_factor = 1;  // what the gradients were multiplied by (1: not clipped)
};

namespace detail {

// Sums of squares into one double in the backend's memory, read back once. The double is the
// group's staging buffer (process_group::value_staging): one allocation per group, not an
// allocate and a deallocate per call, which on NCCL is a cudaFree synchronising the device
// every step.
template <backend B, class Each>
double sum_of_squares_read(process_group<B>& group, Each&& each, const std::function<void(double*)>& combine = {}) {
  auto& engine = group.backend();
  auto* sum = static_cast<double*>(group.value_staging(sizeof(double)));
  fill(engine, sum, 1, dtype::float64, 0.0);
  each(sum);
  if (combine) combine(sum);
  double host = 0;
  engine.copy(&host, sum, sizeof host).wait();
  return host;
}

}  // namespace detail

// After finish(): the norm of the averaged gradients, computed on each rank from its own
// (identical) copy.
template <backend B>
double global_grad_norm(gradient_reducer<B>& reducer) {
  auto& engine = reducer.group().backend();
  const double squares = detail::sum_of_squares_read(reducer.group(), [&](double* sum) {
    for (std::size_t i = 0; i < reducer.gradient_count(); ++i) {
      const auto gradient = reducer.view(i);
      sum_of_squares(engine, gradient.data, gradient.count, gradient.type, sum);
    }
  });
  return detail::square_root(squares);
}

// Multiplies every gradient by min(1, max_norm / (norm + 1e-6)), as
// torch.nn.utils.clip_grad_norm_ does, in the backend's order.
template <backend B>
clip_result clip_grad_norm(gradient_reducer<B>& reducer, double max_norm) {
  clip_result result;
  result.grad_norm = global_grad_norm(reducer);
  result.clip_factor = detail::clip_factor(result.grad_norm, max_norm);
  if (result.clip_factor != 1.0) {
    auto& engine = reducer.group().backend();
    for (std::size_t i = 0; i < reducer.gradient_count(); ++i) {
      const auto gradient = reducer.view(i);
      if (is_floating(gradient.type)) scale(engine, gradient.data, gradient.count, gradient.type, result.clip_factor);
    }
    engine.record().wait();
  }
  return result;
}

// Collective. The norm of the whole model's gradient from every rank's gradient shards
// (after reduce_scatter_grad): one all-reduce of a double.
template <backend B, class T>
double global_grad_norm(sharded_parameters<B, T>& params) {
  auto& group = params.group();
  auto& engine = group.backend();
  const double squares = detail::sum_of_squares_read(
      group,
      [&](double* sum) {
        for (std::size_t u = 0; u < params.unit_count(); ++u) {
          if (params.replicated(u) && group.rank() != 0) continue;  // every rank holds it: count it once
          const auto shard = params.grad_shard(u);
          sum_of_squares(engine, shard.data(), shard.size(), dtype_v<T>, sum);
        }
      },
      [&](double* sum) { group.all_reduce(std::span<double>(sum, 1), op::sum); });
  return detail::square_root(squares);
}

// Collective. The norm, and the factor to clip by: pass result.clip_factor to the optimizer's
// step(grad_scale) (times a loss scaler's inverse, when there is one), so the gradient
// shards are not rewritten.
template <backend B, class T>
clip_result clip_grad_norm(sharded_parameters<B, T>& params, double max_norm) {
  clip_result result;
  result.grad_norm = global_grad_norm(params);
  result.clip_factor = detail::clip_factor(result.grad_norm, max_norm);
  return result;
}

}  // namespace cohort::inline v0
