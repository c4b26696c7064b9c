// A trainer's translation unit on Gloo: run_ranks, a process group, the reducer, sharded
// parameters with Adam, the sampler and the guards, each instantiated as a trainer does.
#include <cohort/cohort.hpp>

#include <cstdio>
#include <memory>
#include <span>
#include <vector>

namespace {

void train(std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
  cohort::process_group<cohort::gloo> pg{store, env};
  const std::vector<std::size_t> sizes{300, 20};
  cohort::gradient_reducer<cohort::gloo> ddp{pg, sizes};
  for (std::size_t i = ddp.gradient_count(); i-- > 0;) ddp.mark_ready(i);
  (void)ddp.finish();
  const std::vector<std::vector<std::size_t>> units{{5, 3}, {4}};
  cohort::sharded_parameters<cohort::gloo, float> weights{pg, units, {.prefetch = 1}};
  cohort::adam opt{weights, {.lr = 3e-4}};
  {
    auto layer = weights.gather(0);
    (void)layer.param(0);
  }
  weights.reduce_scatter_grad(0, std::vector<float>(8)).wait();
  opt.step().wait();
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
