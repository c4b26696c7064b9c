// A trainer's translation unit on Gloo: run_ranks, a process group, the training state at
// zero3 (the strategy whose every path a trainer instantiates: gathers, reductions, the
// optimizer), the sampler and the guards, each instantiated as a trainer does.
#include <cohort/cohort.hpp>

#include <cstdio>
#include <memory>
#include <span>
#include <vector>

namespace {

void train(std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
  cohort::process_group<cohort::gloo> pg{store, env};
  const std::vector<cohort::region> regions{{"w", 0, 300, 0}, {"b", 300, 20, 1, false}};
  cohort::training_state<cohort::gloo> state{pg, regions, {.strategy = cohort::strategy::zero3, .max_grad_norm = 1}};
  state.load_parameters(std::vector<float>(320, 0.5f));
  for (std::size_t r = regions.size(); r-- > 0;) {
    auto layer = state.gather(regions[r].layer);
    (void)layer.param(r);
    (void)state.gradient(r);
    state.mark_ready(r);
  }
  (void)state.step();
  cohort::distributed_sampler sampler{100, pg, {.shuffle = true}};
  sampler.set_epoch(1);
  for (auto index : sampler) (void)index;
  cohort::main_process_first(pg, [] {});
  cohort::rank_logger log(pg);
  log("done");
}

}  // namespace

int main() {
  cohort::run_ranks(2, train);
  return 0;
}
