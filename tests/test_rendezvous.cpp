// What a start costs the store: requests per rank for connect_store, a Gloo group and one
// split, counted by each rank's own client, Gloo's connection of the mesh included. cohort
// connects the mesh itself (one key per rank, one multi_get), so the count must not grow with
// the world; Gloo's own rendezvous read every peer's key with a request or two each. At most
// 16: VALIDATE and the job record's COMPARE_SET (the handshake), the rank claim, the group's
// index, per group its address, WAIT and MULTI_GET and its joined status, the collision check
// of the first group, and the split's entry, WAIT and MULTI_GET.
#include <catch2/catch.hpp>

#include <chrono>
#include <cohort/comm/gloo.hpp>
#include <cohort/comm/process_group.hpp>
#include <cohort/rendezvous/tcp_store.hpp>
#include <cstdio>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "support.hpp"

namespace {

struct counted {
  double per_rank = 0;  // mean
  std::uint64_t most = 0;
};

// Every rank a thread with its own connection, as launched ranks have: connect_store (rank 0
// hosts the store; each rank reads the job's record and claims its rank), then the groups.
counted start_requests(int world) {
  const std::uint16_t port = cohort_test::unused_port();
  std::vector<std::uint64_t> requests(static_cast<std::size_t>(world), 0);
  std::vector<std::shared_ptr<cohort::store>> stores(static_cast<std::size_t>(world));
  cohort_test::run_ranks(world, [&](int rank) {
    auto env = cohort::launch_env::explicit_ranks(rank, world);
    env.master_port = port;
    auto& mine = stores[static_cast<std::size_t>(rank)];
    mine = cohort::connect_store(env);
    cohort::gloo::options opts;
    opts.timeout = std::chrono::seconds(30);
    cohort::process_group<cohort::gloo> pg(mine, env, opts);
    auto half = pg.split(rank % 2, rank);
    // The handshake included.
    requests[static_cast<std::size_t>(rank)] =
        dynamic_cast<cohort::tcp_store&>(*dynamic_cast<cohort::prefix_store&>(*mine).inner()).requests_sent();
    RANK_CHECK(half.has_value());
    half->barrier().wait();
    pg.barrier().wait();
  });
  counted out;
  out.per_rank = static_cast<double>(std::accumulate(requests.begin(), requests.end(), std::uint64_t{0})) / world;
  for (const auto count : requests) out.most = std::max(out.most, count);
  return out;
}

}  // namespace

TEST_CASE("a Gloo group and a split cost each rank the same store requests at any world size", "[rendezvous]") {
  const counted three = start_requests(3);
  const counted nine = start_requests(9);
  std::printf(
      "store requests per rank, group + split, Gloo's mesh included: 3 ranks %.1f (max %llu), "
      "9 ranks %.1f (max %llu)\n",
      three.per_rank, static_cast<unsigned long long>(three.most), nine.per_rank,
      static_cast<unsigned long long>(nine.most));
  CHECK(nine.most == three.most);
  CHECK(nine.most <= 16);
}

namespace {

using namespace std::chrono_literals;

enum class job_ids { distinct, absent, both_none };

// One rank of a job: its store, a Gloo group, one all_reduce of its job's tag. A rank that
// trained with its own job only reads world x tag.
struct rank_outcome {
  bool trained = false;
  float sum = 0;
  std::string failure;
};

cohort::launch_env rank_of(int rank, int world, std::uint16_t port, job_ids ids, char job) {
  if (ids == job_ids::both_none) {  // as torchrun starts it without --rdzv-id
    const std::map<std::string, std::string> vars{
        {"RANK", std::to_string(rank)},       {"WORLD_SIZE", std::to_string(world)},
        {"LOCAL_RANK", std::to_string(rank)}, {"LOCAL_WORLD_SIZE", std::to_string(world)},
        {"MASTER_ADDR", "127.0.0.1"},         {"MASTER_PORT", std::to_string(port)},
        {"TORCHELASTIC_RUN_ID", "none"}};
    return cohort::launch_env::detect([&](std::string_view name) -> std::optional<std::string> {
      const auto found = vars.find(std::string(name));
      if (found == vars.end()) return std::nullopt;
      return found->second;
    });
  }
  auto env = cohort::launch_env::explicit_ranks(rank, world);
  env.master_port = port;
  if (ids == job_ids::distinct) env.run_id = std::string("job-") + job;
  return env;
}

}  // namespace

// Two jobs on one port: where their ids tell them apart, the second is refused; where they do
// not (no id, or torchrun's default `none` on both), a second claim of a rank fails the
// claimant and marks the job, whose ranks stop before their first collective. No rank ever
// computes with another job's, and every rank that fails names the collision.
TEST_CASE("two jobs on one port never compute together, whatever their ids and start times", "[rendezvous]") {
  constexpr int world = 3;
  const float tags[2] = {1.0f, 100.0f};
  for (const job_ids ids : {job_ids::distinct, job_ids::absent, job_ids::both_none}) {
    for (const bool staggered : {false, true}) {
      const std::uint16_t port = cohort_test::unused_port();
      std::vector<rank_outcome> outcome(2 * world);
      // The stores outlive every rank's start: a store host that fails first would otherwise
      // close the store under ranks still reading the collision mark.
      std::vector<std::shared_ptr<cohort::store>> stores(2 * world);
      std::vector<std::thread> ranks;
      for (int job = 0; job < 2; ++job) {
        if (job == 1 && staggered) std::this_thread::sleep_for(300ms);
        for (int rank = 0; rank < world; ++rank)
          ranks.emplace_back([&, job, rank] {
            const std::size_t slot = static_cast<std::size_t>(job * world + rank);
            try {
              cohort::tcp_store_options store_options;
              store_options.timeout = 5s;
              store_options.connect_timeout = 5s;
              stores[slot] =
                  cohort::connect_store(rank_of(rank, world, port, ids, job == 0 ? 'A' : 'B'), store_options);
              cohort::gloo::options opts;
              opts.timeout = 5s;
              cohort::process_group<cohort::gloo> group(stores[slot], cohort::launch_env::explicit_ranks(rank, world),
                                                        opts);
              std::vector<float> value{tags[job]};
              group.all_reduce(std::span<float>(value)).wait();
              outcome[slot].sum = value[0];
              outcome[slot].trained = true;
            } catch (const std::exception& failure) {
              outcome[slot].failure = failure.what();
            }
          });
      }
      for (auto& rank : ranks) rank.join();
      int whole_jobs = 0;
      for (int job = 0; job < 2; ++job) {
        int trained = 0;
        for (int rank = 0; rank < world; ++rank) {
          const auto& mine = outcome[static_cast<std::size_t>(job * world + rank)];
          INFO("ids " << static_cast<int>(ids) << (staggered ? ", staggered" : ", together") << ": job " << job
                      << " rank " << rank << ": " << (mine.trained ? "trained" : mine.failure));
          if (mine.trained) {
            ++trained;
            CHECK(mine.sum == world * tags[job]);  // its own job's ranks only
          } else {
            CHECK_THAT(mine.failure, Catch::Contains("job collision") || Catch::Contains("another job holds") ||
                                         Catch::Contains("never joins one with an id") ||
                                         Catch::Contains("another cohort job") || Catch::Contains("marked collided"));
          }
        }
        if (trained == world) ++whole_jobs;
      }
      // Ids that differ: the job that got the port trains, undisturbed.
      if (ids == job_ids::distinct) CHECK(whole_jobs == 1);
    }
  }
}
