// run_ranks and run_thread_ranks with ranks as threads of this process (the launched half is
// tested by test_multiprocess).
#include <catch2/catch.hpp>

#include <atomic>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>

#include "cohort/run/run_ranks.hpp"

TEST_CASE("run_thread_ranks runs every rank as a thread over one shared store", "[run_ranks]") {
  std::mutex mutex;
  std::set<int> seen;
  std::set<const cohort::store*> stores;
  cohort::run_thread_ranks(3, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
    REQUIRE(env.world_size == 3);
    store->set("rank" + std::to_string(env.rank), std::to_string(env.rank));
    const std::string next = "rank" + std::to_string((env.rank + 1) % 3);
    CHECK(store->get_string(next) == std::to_string((env.rank + 1) % 3));
    std::lock_guard lock(mutex);
    seen.insert(env.rank);
    stores.insert(store.get());
  });
  CHECK(seen == std::set<int>{0, 1, 2});
  CHECK(stores.size() == 1);
}

TEST_CASE("run_thread_ranks rethrows the lowest failing rank's exception after all return", "[run_ranks]") {
  std::atomic<int> returned{0};
  const auto run = [&] {
    cohort::run_thread_ranks(4, [&](std::shared_ptr<cohort::store>, const cohort::launch_env& env) {
      ++returned;
      if (env.rank == 1 || env.rank == 3) throw std::runtime_error("rank " + std::to_string(env.rank));
    });
  };
  REQUIRE_THROWS_WITH(run(), "rank 1");
  CHECK(returned == 4);
}

TEST_CASE("run_thread_ranks refuses a count that is not positive, run_ranks a negative one", "[run_ranks]") {
  const auto nothing = [](std::shared_ptr<cohort::store>, const cohort::launch_env&) {};
  CHECK_THROWS_AS(cohort::run_thread_ranks(0, nothing), cohort::error);
  CHECK_THROWS_AS(cohort::run_thread_ranks(-2, nothing), cohort::error);
  CHECK_THROWS_AS(cohort::run_ranks(-1, nothing), cohort::error);
}

TEST_CASE("run_ranks with a positive count runs the ranks as threads", "[run_ranks]") {
  std::atomic<int> ranks{0};
  cohort::run_ranks(2, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
    CHECK(env.world_size == 2);
    CHECK(store->location().empty());  // a memory_store
    ++ranks;
  });
  CHECK(ranks == 2);
}
