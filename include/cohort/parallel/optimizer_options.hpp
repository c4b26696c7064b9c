#pragma once
// The optimizers' settings, shared by every strategy of training_state, and the step's
// coefficients they all compute the same way.
// Light on purpose: a trainer includes it wherever it configures training.

#include <cstdint>

#include "cohort/comm/detail/elementwise.hpp"
#include "cohort/detail/scalar_math.hpp"

namespace cohort::inline v0 {

struct sgd_options {
  double lr = 0.01;
  double momentum = 0;      // 0: plain SGD, no state
  double weight_decay = 0;  // L2, added to the gradient
};

struct adam_options {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;  // decoupled (AdamW)
};

// What one optimizer step did, the same on every rank: one shape for every strategy.
struct step_result {
  bool skipped = false;    // an inf/NaN on some rank: no rank updated its parameters
  double grad_norm = 0;    // global L2 norm of the averaged, unscaled gradients (before clipping)
  double clip_factor = 1;  // what clipping multiplied the gradients by
  double loss_scale = 1;   // the scale this step's gradients carried
  std::int64_t nonfinite = 0;
  // What the update multiplies the averaged gradients by: the clip factor, over the loss scale,
  // and under a join the world over the ranks that contributed. A trainer's own optimizer
  // (training_options::trainer_optimizer) applies it; 0 when the step is skipped.
  double gradient_scale = 1;
};

namespace detail {
// Clipping by the global norm as PyTorch's clip_grad_norm_: max / (norm + 1e-6) past the max.
inline double clip_factor(double norm, double max_norm) {
  return max_norm > 0 && norm > max_norm ? max_norm / (norm + 1e-6) : 1.0;
}

// Step `steps`'s coefficients (bias corrections 1 - beta^t) for adam_update.
inline adam_coefficients adam_coefficients_at(const adam_options& o, std::uint64_t steps, double grad_scale) {
  const double t = static_cast<double>(steps);
  return {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, 1 - power(o.beta1, t), 1 - power(o.beta2, t), grad_scale};
}
}  // namespace detail

}  // namespace cohort::inline v0
