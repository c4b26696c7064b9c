// A trainer's other translation unit: the training step over a state that main's TU built
// (its model code, its loop), including only the header it uses. Header-only, the
// launch detection, the stores and the group's construction stay in main's TU; this one
// compiles the step's path: gathers, reductions, the optimizer.
#include <cohort/comm/gloo.hpp>
#include <cohort/parallel/training_state.hpp>

#include <cstddef>

cohort::step_result train_step(cohort::training_state<cohort::gloo>& state, std::size_t regions) {
  for (std::size_t r = regions; r-- > 0;) {
    auto layer = state.gather(state.regions()[r].layer);
    (void)layer.param(r);
    (void)state.gradient(r);
    state.mark_ready(r);
  }
  return state.step();
}
