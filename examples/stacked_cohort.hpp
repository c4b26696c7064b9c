#pragma once
// stacked_plain.hpp's trainer converted to cohort: the same buffers, the same pointer
// arithmetic, the same forward, backward, clipping and AdamW, now data-parallel (ddp), with the
// optimizer's work sharded (zero1, zero2) or the parameters too (zero3). The state adopts the
// trainer's buffers where they are (the gradients once the first backward allocates them);
// each layer is gathered around its use, which is free where parameters stay whole and at
// zero3 lands the layer in the trainer's own buffer, where its pointers read it; the backward
// marks each layer as it finishes; step() reduces and takes the global norm, from which the
// trainer clips as before, and its AdamW updates the part this rank owns. Sampling at zero3
// gathers, a collective: every rank samples, rank 0 prints.
#include <cohort/cohort.hpp>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "stacked_model.hpp"

namespace cohort_examples::stacked {

// The buffer's tensors as cohort regions, in its own order: layer 0 the input layer (the
// output's weights too), layers 1 .. blocks the stacked blocks, then the output's bias.
inline std::vector<cohort::region> regions(const shape& s) {
  const std::size_t blocks_at = s.width * s.in + s.width, out_at = blocks_at + s.blocks * (s.width * s.width + s.width);
  auto out = cohort::stacked_regions({{"block_w", s.width * s.width}, {"block_b", s.width}}, s.blocks, 1, blocks_at);
  out.insert(out.begin(), {{"in_w", 0, s.width * s.in, 0}, {"in_b", s.width * s.in, s.width, 0}});
  out.push_back({"out_b", out_at, s.in, s.blocks + 1});
  return out;
}

// Trains from the seed's parameters; returns the final parameters, the last step's mean loss and
// their digest. `options` says the strategy, and whose optimizer updates (trainer_optimizer: this one's).
inline std::vector<float> train_cohort(cohort::process_group<cohort::gloo>& pg, const shape& s, const dataset& data,
                                       const run& r, float& loss, const cohort::training_options& options,
                                       std::string& digest) {
  std::vector<float> params(parameter_count(s)), grads, m(params.size()), v(params.size());
  initialize(s, params.data(), 2024);
  const tensors p = point(s, params.data());
  tensors g{};  // the gradients' tensors, once allocated
  cohort::training_state<cohort::gloo> state(pg, params, grads, regions(s), options);
  const std::size_t micro_steps = r.micro_steps(pg.world_size()), batch = r.rows(pg.world_size()),
                    first = batch * micro_steps * pg.rank();
  std::vector<float> losses;  // the step's micro-batches'
  activations a(s, batch), one(s, 1);
  // The forward over `rows` rows: the mean loss against `target`.
  const auto forward = [&](const float* x, const float* target, std::size_t rows, activations& at) {
    auto embedding = state.gather(0);  // held to the output, which reads it again (tied)
    forward_input(s, p.in_w, p.in_b, x, rows, at);
    for (std::size_t l = 0; l < s.blocks; ++l) {
      auto block = state.gather(l + 1);
      forward_block(s, l, p.block_w + l * s.width * s.width, p.block_b + l * s.width, rows, at);
    }
    auto output = state.gather(s.blocks + 1);
    return forward_output(s, p.in_w, p.out_b, target, rows, at);
  };
  const auto backward = [&](const float* x) {
    if (grads.empty()) {  // allocated in the first backward, as llm.c does
      grads.assign(params.size(), 0.0f);
      g = point(s, grads.data());
      state.bind_gradients(grads);
    }
    auto embedding = state.gather(0);
    backward_output(s, p.in_w, g.in_w, g.out_b, batch, a);
    (void)state.gather(s.blocks + 1);  // zero3: the output's backward is done; reduced from the next gather on
    state.mark_layer_ready(s.blocks + 1);
    for (std::size_t l = s.blocks; l-- > 0;) {
      auto block = state.gather(l + 1);
      backward_block(s, l, p.block_w + l * s.width * s.width, g.block_w + l * s.width * s.width,
                     g.block_b + l * s.width, batch, a);
      state.mark_layer_ready(l + 1);
    }
    backward_input(s, x, g.in_w, g.in_b, batch, a);
  };
  for (int step = 0; step < r.steps; ++step) {
    std::fill(grads.begin(), grads.end(), 0.0f);
    losses.clear();
    for (std::size_t k = 0; k < micro_steps; ++k) {
      std::optional<decltype(state.no_sync())> accumulating;  // each micro-step but the last: reduced later
      if (k + 1 < micro_steps) accumulating.emplace(state);
      const float* x = data.inputs(step, first + k * batch);
      losses.push_back(forward(x, data.targets(step, first + k * batch), batch, a));
      backward(x);
    }
    const auto result = state.step();
    const double norm = result.grad_norm;  // every rank's gradients, averaged
    const double scale = clip_scale(norm, r.max_grad_norm);
    for (const auto& o : state.owned_spans())  // none with the state's optimizer (stacked --optimizer cohort)
      adamw(o.parameters.data(), o.gradients.data(), &m[o.owned], &v[o.owned], o.parameters.size(), step + 1, r.adam,
            scale);
    if (state.trainer_optimizer()) state.publish_parameters();
    if (step % r.sample_every == 0) {  // a forward-only pass on one row of the step's batch
      auto evaluating = state.evaluation();
      const float sampled = forward(data.inputs(step, 0), data.targets(step, 0), 1, one);
      if (pg.rank() == 0) std::printf("step %d: sample loss %.6f\n", step, sampled);
    }
  }
  loss = cohort::canonical_mean(pg, std::span<const float>(losses));  // the same bits at any world size
  digest = cohort::parameter_sha256(state);  // where the shards live, the same at any world size
  return state.gather_parameters();          // at zero3 the buffer holds this rank's shard outside a gather
}

}  // namespace cohort_examples::stacked
