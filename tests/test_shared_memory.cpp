// The Gloo backend's intra-host transport (cohort/comm/detail/shared_memory_channel.hpp):
// ranks of one host meet in shared memory for all-reduce, reduce-scatter and all-gather. The
// results must equal a reference computed here, at sizes that cross the slot's chunks and
// leave some ranks' parts empty, in place and out; a group where one rank opts out stays on
// TCP on every rank; a forged segment record is refused; and ranks in different calls never
// read each other's data, and fail as they do over TCP. (test_process_group runs every
// collective over both transports: once as it is, once as test_process_group_tcp.)
#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <cohort/comm/detail/shared_memory_channel.hpp>
#include <cohort/comm/gloo.hpp>
#include <cohort/comm/ops.hpp>
#include <cohort/comm/process_group.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "support.hpp"

using namespace std::chrono_literals;
using cohort::op;
using group = cohort::process_group<cohort::gloo>;

namespace {

group make_group(const std::shared_ptr<cohort::memory_store>& store, int rank, int world, bool shared_memory = true,
                 std::chrono::milliseconds timeout = 20s) {
  cohort::gloo::options opts;
  opts.timeout = timeout;
  opts.shared_memory = shared_memory;
  return group(store, cohort::launch_env::explicit_ranks(rank, world), opts);
}

// Integer-valued floats: every order of addition gives the same sum, so the reference is exact.
float contribution(int rank, std::size_t index) { return static_cast<float>((rank * 7 + index * 3) % 11); }

// Sizes around the slot's chunk (in floats), and below the world (some ranks' parts empty).
std::vector<std::size_t> sizes_for(int world) {
  const std::size_t chunk = cohort::detail::shared_memory_channel::default_slot_bytes / sizeof(float);
  return {1, static_cast<std::size_t>(world) - 1, 1000, chunk - 1, chunk + 1, 2 * chunk + chunk / 3 + 5};
}

}  // namespace

TEST_CASE("collectives through shared memory equal the reference across chunks, in place and out",
          "[shared_memory][gloo]") {
  for (int world : {2, 3, 4}) {
    auto store = std::make_shared<cohort::memory_store>();
    cohort_test::run_ranks(world, [&](int rank) {
      auto pg = make_group(store, rank, world);
      RANK_CHECK(pg.backend().uses_shared_memory(), "every rank is on this host: the group should use shared memory");
      const auto w = static_cast<std::size_t>(world);
      for (const std::size_t n : sizes_for(world)) {
        std::vector<float> in(n), summed(n, -1.0f), maxed(n, -1.0f), averaged(n);
        for (std::size_t i = 0; i < n; ++i) in[i] = contribution(rank, i);
        averaged = in;
        pg.all_reduce(std::span<const float>(in), std::span<float>(summed), op::sum).wait();
        pg.all_reduce(std::span<const float>(in), std::span<float>(maxed), op::max).wait();
        pg.all_reduce(std::span<float>(averaged), op::avg).wait();  // in place
        std::size_t wrong = 0;
        for (std::size_t i = 0; i < n; ++i) {
          float sum = 0, most = 0;
          for (int r = 0; r < world; ++r) {
            sum += contribution(r, i);
            most = std::max(most, contribution(r, i));
          }
          wrong += summed[i] != sum || maxed[i] != most ||
                   std::abs(averaged[i] - sum / static_cast<float>(world)) > 1e-6f * sum;
        }
        RANK_CHECK(wrong == 0, "all_reduce, world " << world << ", n " << n << ": " << wrong << " elements off");

        // reduce_scatter: out of place, and in place (out is this rank's own block of in).
        std::vector<float> blocks(n * w);
        for (std::size_t i = 0; i < n * w; ++i) blocks[i] = contribution(rank, i);
        std::vector<float> mine(n, -1.0f);
        pg.reduce_scatter(std::span<const float>(blocks), std::span<float>(mine), op::sum).wait();
        std::vector<float> in_place = blocks;
        const std::size_t own = static_cast<std::size_t>(rank) * n;
        pg.reduce_scatter(std::span<const float>(in_place), std::span<float>(in_place.data() + own, n), op::sum).wait();
        for (std::size_t i = 0; i < n; ++i) {
          float sum = 0;
          for (int r = 0; r < world; ++r) sum += contribution(r, own + i);
          wrong += mine[i] != sum || in_place[own + i] != sum;
        }
        RANK_CHECK(wrong == 0, "reduce_scatter, world " << world << ", n " << n << ": " << wrong << " elements off");

        // all_gather: out of place, and in place (in is out's own block).
        std::vector<float> gathered(n * w, -1.0f), gathered_in_place(n * w, -1.0f);
        for (std::size_t i = 0; i < n; ++i) gathered_in_place[own + i] = in[i];
        pg.all_gather(std::span<const float>(in), std::span<float>(gathered)).wait();
        pg.all_gather(std::span<const float>(gathered_in_place.data() + own, n), std::span<float>(gathered_in_place))
            .wait();
        for (std::size_t r = 0; r < w; ++r)
          for (std::size_t i = 0; i < n; ++i) {
            const float want = contribution(static_cast<int>(r), i);
            wrong += gathered[r * n + i] != want || gathered_in_place[r * n + i] != want;
          }
        RANK_CHECK(wrong == 0, "all_gather, world " << world << ", n " << n << ": " << wrong << " elements off");
      }
    });
  }
}

TEST_CASE("one rank that opts out of shared memory keeps the whole group on TCP", "[shared_memory][gloo]") {
  constexpr int world = 3;
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world, /*shared_memory=*/rank != 1);
    RANK_CHECK(!pg.backend().uses_shared_memory(), "rank 1 opted out: no rank may use shared memory");
    std::vector<float> values(4099);
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = contribution(rank, i);
    pg.all_reduce(std::span<float>(values), op::sum).wait();
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < values.size(); ++i)
      wrong += values[i] != contribution(0, i) + contribution(1, i) + contribution(2, i);
    RANK_CHECK(wrong == 0, wrong << " elements off over TCP");
  });
}

TEST_CASE("a segment record that does not lead to its segment is refused", "[shared_memory]") {
  using cohort::detail::shared_memory_channel;
  auto first = shared_memory_channel::create(0, 2);
  auto second = shared_memory_channel::create(1, 2);
  REQUIRE(first);
  REQUIRE(second);
  const std::vector<shared_memory_channel::peer_process> processes(2);
  // The true record maps; one whose token differs (another process's descriptor under the
  // same number), a size that differs, or no record at all does not.
  REQUIRE(first->map_peers({first->published(), second->published()}, processes));
  std::string forged = second->published();
  forged.back() = forged.back() == '1' ? '2' : '1';  // the slot size, last
  CHECK_FALSE(first->map_peers({first->published(), forged}, processes));
  std::string other_token = second->published();
  const auto token_at = other_token.find(' ', other_token.find(' ', other_token.find(' ') + 1) + 1) + 1;
  other_token[token_at] = other_token[token_at] == '1' ? '2' : '1';
  CHECK_FALSE(first->map_peers({first->published(), other_token}, processes));
  CHECK_FALSE(first->map_peers({first->published(), "tcp"}, processes));
}

namespace {

// An all_reduce of 1000 floats on rank 0 and 2000 on the others, as the same call number:
// over shared memory the phases would line up, the data not. What it ended with, how long it
// took, and how many output elements it wrote (none may be: the peers are in another call).
struct mismatch_outcome {
  std::string message;
  std::chrono::steady_clock::duration took{};
  std::size_t touched = 0;
};

mismatch_outcome mismatched_all_reduce(group& pg) {
  const std::size_t n = pg.rank() == 0 ? 1000 : 2000;
  std::vector<float> in(n, 1.0f), out(n, -7.0f);
  mismatch_outcome outcome;
  const auto started = std::chrono::steady_clock::now();
  try {
    pg.all_reduce(std::span<const float>(in), std::span<float>(out), op::sum).wait();
  } catch (const cohort::error& failure) {
    outcome.message = failure.what();
  }
  outcome.took = std::chrono::steady_clock::now() - started;
  for (float value : out) outcome.touched += value != -7.0f;
  return outcome;
}

}  // namespace

TEST_CASE("ranks in different calls never read each other's slots, and fail naming both calls",
          "[shared_memory][gloo][faults]") {
  constexpr int world = 2;
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world);
    RANK_CHECK(pg.backend().uses_shared_memory(), "the group should use shared memory");
    const auto outcome = mismatched_all_reduce(pg);
    RANK_CHECK(!outcome.message.empty(), "the mismatched all_reduce returned");
    RANK_CHECK(outcome.message.find("different calls") != std::string::npos,
               "the error does not say why: " << outcome.message);
    RANK_CHECK(outcome.took < 15s,
               "the mismatch took " << std::chrono::duration<double>(outcome.took).count() << " s to end");
    RANK_CHECK(outcome.touched == 0, outcome.touched << " output elements were written by a call the peer is not in");
  });
}

// A peer that posted its part of another call and then closed (its own shorter timeout ended
// it) will post nothing more: the rank still waiting on it fails at once, naming it, instead
// of waiting out its own timeout. (No progress monitor here: nothing else would end the wait.)
TEST_CASE("a peer that posted in another call and closed ends the wait at once", "[shared_memory][gloo][faults]") {
  constexpr int world = 2;
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    cohort::gloo::options opts;
    opts.timeout = rank == 0 ? 30s : 1s;
    opts.compare_calls_after = 0ms;
    group pg(store, cohort::launch_env::explicit_ranks(rank, world), opts);
    RANK_CHECK(pg.backend().uses_shared_memory(), "the group should use shared memory");
    const auto outcome = mismatched_all_reduce(pg);
    RANK_CHECK(!outcome.message.empty(), "the mismatched all_reduce returned");
    if (rank == 0) {
      RANK_CHECK(outcome.took < 10s, "rank 0 waited " << std::chrono::duration<double>(outcome.took).count()
                                                      << " s for a peer that had closed: " << outcome.message);
      RANK_CHECK(outcome.message.find("rank 1") != std::string::npos,
                 "the error does not name rank 1: " << outcome.message);
    }
    RANK_CHECK(outcome.touched == 0, outcome.touched << " output elements were written by a call the peer is not in");
  });
}
