// hello_collectives: every rank contributes rank + 1; the main rank prints the sum.
//
//   hello_collectives --ranks 4                      # 4 ranks as threads of this process
//   mpirun -np 4 hello_collectives                   # one process per rank (Open MPI, MPICH)
//   torchrun --nproc-per-node 4 --no-python ./hello_collectives
//   srun -n 4 hello_collectives
//
// Without --ranks the program reads its launcher's environment, meets the other ranks
// through a TCP store at MASTER_ADDR:MASTER_PORT (or torchrun's own agent store), and runs
// the same collective over Gloo.
#include <cohort/cohort.hpp>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  int threads = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--ranks") == 0 && i + 1 < argc) {
      threads = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--ranks N]\n", argv[0]);
      return 2;
    }
  }
  try {
    bool correct = true;
    cohort::run_ranks(threads, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
      cohort::process_group<cohort::gloo> pg{store, env};
      std::vector<std::int64_t> value{pg.rank() + 1};
      pg.all_reduce(std::span<std::int64_t>(value), cohort::op::sum).wait();
      const std::int64_t expected = static_cast<std::int64_t>(pg.world_size()) * (pg.world_size() + 1) / 2;
      if (cohort::is_main_process(pg)) {
        std::printf("hello from %s: sum of rank+1 over %d ranks = %lld (expected %lld)\n",
                    std::string(cohort::to_string(env.source)).c_str(), pg.world_size(),
                    static_cast<long long>(value[0]), static_cast<long long>(expected));
        correct = value[0] == expected;
      }
    });
    return correct ? 0 : 1;
  } catch (const std::exception& failure) {
    std::fprintf(stderr, "%s\n", failure.what());
    return 1;
  }
}
