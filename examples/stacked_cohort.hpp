#pragma once
// stacked_plain.hpp's trainer converted to cohort: the same buffers, the same pointer
// arithmetic, the same forward, backward and AdamW, now data-parallel (ddp) or with the
// optimizer's work sharded (zero1, zero2). The state adopts the trainer's two buffers where
// they are; the backward marks each layer as it finishes; step() reduces, takes the global
// norm and the skip decision, and the trainer's AdamW updates the part this rank owns.
#include <cohort/cohort.hpp>

#include <algorithm>
#include <span>
#include <vector>

#include "stacked_model.hpp"

namespace cohort_examples::stacked {

// The buffer's tensors as cohort regions, in its own order: layer 0 the input layer, layers 1
// .. blocks the stacked blocks, then the output layer.
inline std::vector<cohort::region> regions(const shape& s) {
  const std::size_t blocks_at = s.width * s.in + s.width, out_at = blocks_at + s.blocks * (s.width * s.width + s.width);
  std::vector<cohort::region> out{{"in_w", 0, s.width * s.in, 0}, {"in_b", s.width * s.in, s.width, 0}};
  const auto blocks =
      cohort::stacked_regions({{"block_w", s.width * s.width}, {"block_b", s.width}}, s.blocks, 1, blocks_at);
  out.insert(out.end(), blocks.begin(), blocks.end());
  out.push_back({"out_w", out_at, s.out * s.width, s.blocks + 1});
  out.push_back({"out_b", out_at + s.out * s.width, s.out, s.blocks + 1});
  return out;
}

// Trains from the seed's parameters; returns the final parameters and the last step's mean
// loss. `options` says the strategy, and whose optimizer updates (trainer_optimizer: this one's).
inline std::vector<float> train_cohort(cohort::process_group<cohort::gloo>& pg, const shape& s, const dataset& data,
                                       const run& r, float& loss, const cohort::training_options& options) {
  std::vector<float> params(parameter_count(s)), grads(params.size()), m(params.size()), v(params.size());
  initialize(s, params.data(), 2024);
  const tensors p = point(s, params.data()), g = point(s, grads.data());
  cohort::training_state<cohort::gloo> state(pg, std::span(params), std::span(grads), regions(s), options);
  const std::size_t batch = r.batch / static_cast<std::size_t>(pg.world_size());
  const std::size_t first = batch * static_cast<std::size_t>(pg.rank());
  activations a(s, batch);
  for (int step = 0; step < r.steps; ++step) {
    const float* x = data.inputs(step, first);
    std::fill(grads.begin(), grads.end(), 0.0f);
    forward_input(s, p.in_w, p.in_b, x, batch, a);
    for (std::size_t l = 0; l < s.blocks; ++l)
      forward_block(s, l, p.block_w + l * s.width * s.width, p.block_b + l * s.width, batch, a);
    loss = forward_output(s, p.out_w, p.out_b, data.targets(step, first), batch, a);
    backward_output(s, p.out_w, g.out_w, g.out_b, batch, a);
    state.mark_layer_ready(s.blocks + 1);
    for (std::size_t l = s.blocks; l-- > 0;) {
      backward_block(s, l, p.block_w + l * s.width * s.width, g.block_w + l * s.width * s.width,
                     g.block_b + l * s.width, batch, a);
      state.mark_layer_ready(l + 1);
    }
    backward_input(s, x, g.in_w, g.in_b, batch, a);
    const auto result = state.step();
    if (!*options.trainer_optimizer) continue;
    if (!result.skipped)
      for (const auto& o : state.owned_spans())
        adamw(o.parameters.data(), o.gradients.data(), &m[o.owned], &v[o.owned], o.parameters.size(), step + 1, r.adam,
              result.gradient_scale);
    state.publish_parameters();
  }
  loss = cohort::all_reduce_value(pg, loss, cohort::op::avg);
  return params;
}

}  // namespace cohort_examples::stacked
