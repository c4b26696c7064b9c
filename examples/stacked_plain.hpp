#pragma once
// The trainer of stacked_model.hpp without cohort: one process, the whole batch, its own
// pointers into its own buffers, its own clipping and AdamW, with a C trainer's habits (llm.c's):
// the gradient buffer allocated in the first backward, the output tied to the input layer, a
// forward-only sample every few steps, printed. stacked_cohort.hpp is this file converted to
// cohort; `diff` shows the conversion.
#include <algorithm>
#include <cstdio>
#include <vector>

#include "stacked_model.hpp"

namespace cohort_examples::stacked {

// Trains from the seed's parameters; returns the final parameters and the last step's loss.
inline std::vector<float> train_plain(const shape& s, const dataset& data, const run& r, float& loss) {
  std::vector<float> params(parameter_count(s)), grads, m(params.size()), v(params.size());
  initialize(s, params.data(), 2024);
  const tensors p = point(s, params.data());
  tensors g{};  // the gradients' tensors, once allocated
  const std::size_t micro_steps = r.micro_steps(1), batch = r.rows(1), first = 0;
  std::vector<float> losses;  // the step's micro-batches'
  activations a(s, batch), one(s, 1);
  // The forward over `rows` rows: the mean loss against `target`.
  const auto forward = [&](const float* x, const float* target, std::size_t rows, activations& at) {
    forward_input(s, p.in_w, p.in_b, x, rows, at);
    for (std::size_t l = 0; l < s.blocks; ++l) {
      forward_block(s, l, p.block_w + l * s.width * s.width, p.block_b + l * s.width, rows, at);
    }
    return forward_output(s, p.in_w, p.out_b, target, rows, at);
  };
  const auto backward = [&](const float* x) {
    if (grads.empty()) {  // allocated in the first backward, as llm.c does
      grads.assign(params.size(), 0.0f);
      g = point(s, grads.data());
    }
    backward_output(s, p.in_w, g.in_w, g.out_b, batch, a);
    for (std::size_t l = s.blocks; l-- > 0;) {
      backward_block(s, l, p.block_w + l * s.width * s.width, g.block_w + l * s.width * s.width,
                     g.block_b + l * s.width, batch, a);
    }
    backward_input(s, x, g.in_w, g.in_b, batch, a);
  };
  for (int step = 0; step < r.steps; ++step) {
    std::fill(grads.begin(), grads.end(), 0.0f);
    losses.clear();
    for (std::size_t k = 0; k < micro_steps; ++k) {
      const float* x = data.inputs(step, first + k * batch);
      losses.push_back(forward(x, data.targets(step, first + k * batch), batch, a));
      backward(x);
    }
    for (float& gradient : grads) gradient /= static_cast<float>(micro_steps);  // the micro-batches' mean
    const double norm = gradient_norm(grads.data(), grads.size());
    const double scale = clip_scale(norm, r.max_grad_norm);
    adamw(params.data(), grads.data(), m.data(), v.data(), params.size(), step + 1, r.adam, scale);
    if (step % r.sample_every == 0) {  // a forward-only pass on one row of the step's batch
      const float sampled = forward(data.inputs(step, 0), data.targets(step, 0), 1, one);
      std::printf("step %d: sample loss %.6f\n", step, sampled);
    }
  }
  loss = mean(losses);
  return params;
}

}  // namespace cohort_examples::stacked
