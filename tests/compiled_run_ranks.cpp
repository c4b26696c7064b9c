// A trainer's unit as the default targets compile it (issue 44), compiled only: it runs its ranks
// with a lambda of its own and throws cohort's error. The ranks' threads, their memory_store and
// the error's message are compiled once, in the library; this unit only calls them
// (unit_defines_none.sh).
#include <cohort/error.hpp>
#include <cohort/run/run_ranks.hpp>

#include <memory>

int main() {
  cohort::run_ranks(2, [](std::shared_ptr<cohort::store>, const cohort::launch_env& env) {
    if (env.world_size != 2) throw cohort::error(env.rank, "compiled_run_ranks", "a world of 2 expected");
  });
}
