// The smallest real use of cohort, built three ways (installed package, add_subdirectory,
// plain -I include): two ranks as threads all-reduce over Gloo and check the sum.
#include <cohort/cohort.hpp>

#include <cstdio>
#include <memory>
#include <thread>
#include <vector>

int main() {
  auto store = std::make_shared<cohort::memory_store>();
  constexpr int world = 2;
  std::vector<float> results(world);
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < world; ++rank) {
    ranks.emplace_back([&, rank] {
      cohort::process_group<cohort::gloo> pg{store, cohort::launch_env::explicit_ranks(rank, world)};
      std::vector<float> value{static_cast<float>(rank + 1)};
      pg.all_reduce(std::span<float>(value), cohort::op::sum).wait();
      results[static_cast<std::size_t>(rank)] = value[0];
    });
  }
  for (auto& thread : ranks) thread.join();
  const bool ok = results[0] == 3.0f && results[1] == 3.0f;
  std::printf("cohort %s consumer: all_reduce sum over %d ranks = %g (%s)\n", COHORT_VERSION_STRING, world,
              static_cast<double>(results[0]), ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
