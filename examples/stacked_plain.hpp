#pragma once
// The trainer of stacked_model.hpp without cohort: one process, the whole batch, its own
// pointers into its own buffers, its own clipping and AdamW. stacked_cohort.hpp is this file
// converted to cohort; `diff` shows the conversion.
#include <algorithm>
#include <vector>

#include "stacked_model.hpp"

namespace cohort_examples::stacked {

// Trains from the seed's parameters; returns the final parameters and the last step's loss.
inline std::vector<float> train_plain(const shape& s, const dataset& data, const run& r, float& loss) {
  std::vector<float> params(parameter_count(s)), grads(params.size()), m(params.size()), v(params.size());
  initialize(s, params.data(), 2024);
  const tensors p = point(s, params.data()), g = point(s, grads.data());
  const std::size_t batch = r.batch, first = 0;
  activations a(s, batch);
  for (int step = 0; step < r.steps; ++step) {
    const float* x = data.inputs(step, first);
    std::fill(grads.begin(), grads.end(), 0.0f);
    forward_input(s, p.in_w, p.in_b, x, batch, a);
    for (std::size_t l = 0; l < s.blocks; ++l)
      forward_block(s, l, p.block_w + l * s.width * s.width, p.block_b + l * s.width, batch, a);
    loss = forward_output(s, p.out_w, p.out_b, data.targets(step, first), batch, a);
    backward_output(s, p.out_w, g.out_w, g.out_b, batch, a);
    for (std::size_t l = s.blocks; l-- > 0;)
      backward_block(s, l, p.block_w + l * s.width * s.width, g.block_w + l * s.width * s.width,
                     g.block_b + l * s.width, batch, a);
    backward_input(s, x, g.in_w, g.in_b, batch, a);
    const double scale = clip_scale(grads.data(), grads.size(), r.max_grad_norm);
    adamw(params.data(), grads.data(), m.data(), v.data(), params.size(), step + 1, r.adam, scale);
  }
  return params;
}

}  // namespace cohort_examples::stacked
