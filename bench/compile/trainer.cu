// A CUDA trainer's translation unit on NCCL: the reducer, sharded parameters and Adam, whose
// element-wise work nvcc compiles into kernels.
#include <cohort/cohort.hpp>

#include <memory>
#include <vector>

namespace {

void train(std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
  cohort::process_group<cohort::nccl> pg{store, env};
  const std::vector<std::size_t> sizes{300, 20};
  cohort::gradient_reducer<cohort::nccl> ddp{pg, sizes, {.compress = cohort::compression::bfloat16}};
  for (std::size_t i = ddp.gradient_count(); i-- > 0;) ddp.mark_ready(i);
  (void)ddp.finish();
  const std::vector<std::vector<std::size_t>> units{{5, 3}, {4}};
  cohort::sharded_parameters<cohort::nccl, float> weights{pg, units, {.prefetch = 1}};
  cohort::adam opt{weights, {.lr = 3e-4}};
  {
    auto layer = weights.gather(0);
    (void)layer.param(0);
  }
  opt.step().wait();
}

}  // namespace

int main() {
  cohort::run_ranks(1, train);
  return 0;
}
