// A CUDA trainer's translation unit on NCCL: the training state at zero3 over bfloat16
// parameters (fp32 masters, AdamW), whose element-wise work nvcc compiles into kernels.
#include <cohort/cohort.hpp>

#include <memory>
#include <vector>

namespace {

void train(std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
  cohort::process_group<cohort::nccl> pg{store, env};
  const std::vector<cohort::region> regions{{"w", 0, 300, 0}, {"b", 300, 20, 1, false}};
  cohort::training_state<cohort::nccl, cohort::bfloat16> state{
      pg, regions, {.strategy = cohort::strategy::zero3, .adam = {.lr = 3e-4}, .max_grad_norm = 1}};
  state.load_parameters(std::vector<cohort::bfloat16>(320));
  for (std::size_t r = regions.size(); r-- > 0;) {
    auto layer = state.gather(regions[r].layer);
    (void)layer.param(r);
    (void)state.gradient(r);
    state.mark_ready(r);
  }
  (void)state.step();
}

}  // namespace

int main() {
  cohort::run_ranks(1, train);
  return 0;
}
