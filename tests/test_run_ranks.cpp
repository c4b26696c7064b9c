// run_ranks and run_thread_ranks with ranks as threads of this process (the launched half is
// tested by test_multiprocess).
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cohort/comm/gloo.hpp>
#include <cohort/comm/process_group.hpp>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "cohort/comm/detail/failure_report.hpp"
#include "cohort/run/run_ranks.hpp"
#include "rank_failures.hpp"

TEST_CASE("run_thread_ranks runs every rank as a thread over one shared store", "[run_ranks]") {
  // Catch's assertions are not thread-safe: the ranks record, the test checks afterwards.
  std::mutex mutex;
  std::set<int> seen;
  std::set<const cohort::store*> stores;
  std::set<int> worlds;
  int read_back = 0;
  cohort::run_thread_ranks(3, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
    store->set("rank" + std::to_string(env.rank), std::to_string(env.rank));
    const std::string next = "rank" + std::to_string((env.rank + 1) % 3);
    const bool read = store->get_string(next) == std::to_string((env.rank + 1) % 3);
    std::lock_guard lock(mutex);
    worlds.insert(env.world_size);
    read_back += read ? 1 : 0;
    seen.insert(env.rank);
    stores.insert(store.get());
  });
  CHECK(worlds == std::set<int>{3});
  CHECK(read_back == 3);
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
  std::atomic<int> ranks{0}, as_expected{0};
  cohort::run_ranks(2, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
    if (env.world_size == 2 && store->location().empty()) ++as_expected;  // a memory_store
    ++ranks;
  });
  CHECK(ranks == 2);
  CHECK(as_expected == 2);
}

// A collective issued by one rank alone (at ZeRO-3, rank 0 gathering a layer to sample from
// the model while the others are elsewhere): every rank fails within seconds, not after the
// group's timeout, and the error names rank 0's call with its context.
TEST_CASE("a collective one rank issues alone fails within seconds on every rank, naming it", "[run_ranks][faults]") {
  for (const bool finished : {false, true}) {
    INFO((finished ? "ranks 1, 2 finished their run" : "ranks 1, 2 are in a barrier"));
    const auto [errors, took] = cohort_test::run_ranks_keeping_errors(
        3, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
          cohort::gloo::options opts;
          opts.timeout = std::chrono::seconds(60);  // what ends the calls is not the timeout
          cohort::process_group<cohort::gloo> pg{store, env, opts};
          std::vector<float> mine(4, static_cast<float>(env.rank)), all(12);
          pg.all_reduce(mine).wait();
          if (env.rank == 0) {
            auto scope = pg.call_context("sample");
            pg.all_gather(mine, all).wait();
          } else if (!finished) {
            auto scope = pg.call_context("end of epoch");
            pg.barrier().wait();
          }
        });
    for (const auto& text : errors) UNSCOPED_INFO(text);
    CHECK(took < 10.0);
    CHECK_THAT(errors[0], Catch::Contains("all_gather #2 (float x 4) [sample]"));
    if (finished) {
      CHECK_THAT(errors[0], Catch::Contains("ranks 1, 2 left the group after issuing 1 collective"));
    } else {
      for (int rank = 0; rank < 3; ++rank)
        CHECK_THAT(errors[static_cast<std::size_t>(rank)],
                   Catch::Contains("rank 0 is in all_gather #2 (float x 4) [sample]; ranks 1, 2 are in barrier #2 "
                                   "[end of epoch]"));
    }
  }
}

// A group that failed says so in its status key, and its destructor's `left` does not
// overwrite that: a peer reading the key late (run_ranks' end counts, a culprit search) would
// otherwise take a rank that failed in a call for one that left the group early, and blame it.
TEST_CASE("a rank's failed status is kept when its group is destroyed after, and a clean end says left",
          "[run_ranks][faults]") {
  using cohort::detail::rank_activity;
  auto store = std::make_shared<cohort::memory_store>();
  cohort::detail::status_board failing(store, 0, 2, std::chrono::seconds(2));
  cohort::detail::status_board clean(store, 1, 2, std::chrono::seconds(2));
  const auto status = [](rank_activity activity, std::uint64_t completed, std::string note) {
    cohort::detail::rank_status out;
    out.activity = activity;
    out.issued = 3;
    out.completed = completed;
    out.note = std::move(note);
    return out;
  };
  failing.publish(status(rank_activity::failed, 2, "timed out"));
  CHECK_FALSE(failing.try_publish_on_group_store(status(rank_activity::left, 2, "")));
  CHECK(clean.try_publish_on_group_store(status(rank_activity::left, 3, "")));
  const auto statuses = clean.read();
  REQUIRE(statuses.size() == 2);
  REQUIRE(statuses[0]);
  REQUIRE(statuses[1]);
  CHECK(statuses[0]->activity == rank_activity::failed);
  CHECK(statuses[0]->note == "timed out");
  CHECK(statuses[1]->activity == rank_activity::left);
}
