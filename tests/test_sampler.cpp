// distributed_sampler: torch-compatible assignment, coverage, determinism, epochs, warnings,
// padding and uneven (even_batches = false) shares.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <numeric>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "cohort/data/sampler.hpp"
#include "support.hpp"

#if __has_include(<gloo/context.h>)
#include "cohort/comm/gloo.hpp"
#include "cohort/comm/process_group.hpp"
#endif

namespace {

using index_list = std::vector<std::uint64_t>;

// torch.utils.data.DistributedSampler.__iter__ with shuffle=False, transcribed step by step
// (floating-point math.ceil, list padding by repetition, slicing) so that it shares no
// arithmetic with the sampler under test.
index_list torch_assignment(std::int64_t n, std::int64_t world, std::int64_t rank, bool drop_last) {
  std::int64_t num_samples;
  if (drop_last && n % world != 0)
    num_samples = static_cast<std::int64_t>(std::ceil(static_cast<double>(n - world) / static_cast<double>(world)));
  else
    num_samples = static_cast<std::int64_t>(std::ceil(static_cast<double>(n) / static_cast<double>(world)));
  const std::int64_t total_size = num_samples * world;

  index_list indices(static_cast<std::size_t>(n));
  std::iota(indices.begin(), indices.end(), 0);
  if (!drop_last) {
    const std::int64_t padding_size = total_size - n;
    if (padding_size <= n) {
      indices.insert(indices.end(), indices.begin(), indices.begin() + padding_size);
    } else {
      const auto repeats =
          static_cast<std::int64_t>(std::ceil(static_cast<double>(padding_size) / static_cast<double>(n)));
      index_list repeated;
      for (std::int64_t r = 0; r < repeats; ++r) repeated.insert(repeated.end(), indices.begin(), indices.end());
      indices.insert(indices.end(), repeated.begin(), repeated.begin() + padding_size);
    }
  } else {
    indices.resize(static_cast<std::size_t>(total_size));
  }
  REQUIRE(static_cast<std::int64_t>(indices.size()) == total_size);
  index_list mine;
  for (std::int64_t p = rank; p < total_size; p += world) mine.push_back(indices[static_cast<std::size_t>(p)]);
  REQUIRE(static_cast<std::int64_t>(mine.size()) == num_samples);
  return mine;
}

std::vector<index_list> all_ranks(std::uint64_t n, int world, cohort::sampler_options options,
                                  std::uint64_t epoch = 0) {
  std::vector<index_list> result;
  for (int rank = 0; rank < world; ++rank) {
    cohort::distributed_sampler sampler{n, world, rank, options};
    sampler.set_epoch(epoch);
    result.push_back(sampler.indices());
  }
  return result;
}

struct fake_group {
  int my_rank, my_size;
  int rank() const { return my_rank; }
  int world_size() const { return my_size; }
};

}  // namespace

TEST_CASE("sampler: shuffle off assigns exactly like torch's DistributedSampler", "[sampler]") {
  struct scenario {
    std::int64_t n, world;
    bool drop_last;
  };
  const std::vector<scenario> scenarios = {{10, 3, false},   {10, 3, true},   {10, 4, false}, {10, 4, true},
                                           {12, 4, false},   {12, 4, true},   {3, 4, false},  {3, 4, true},
                                           {5, 8, false},    {1, 1, false},   {7, 7, true},   {0, 2, false},
                                           {101, 16, false}, {101, 16, true}, {2, 7, false}};
  for (const auto& s : scenarios) {
    for (std::int64_t rank = 0; rank < s.world; ++rank) {
      INFO("n=" << s.n << " world=" << s.world << " rank=" << rank << " drop_last=" << s.drop_last);
      cohort::distributed_sampler sampler{static_cast<std::uint64_t>(s.n),
                                          static_cast<int>(s.world),
                                          static_cast<int>(rank),
                                          {.shuffle = false, .seed = 0, .drop_last = s.drop_last}};
      const index_list expected = torch_assignment(s.n, s.world, rank, s.drop_last);
      CHECK(sampler.size() == expected.size());
      CHECK(sampler.indices() == expected);
      index_list iterated;
      for (auto index : sampler) iterated.push_back(index);
      CHECK(iterated == expected);
    }
  }
}

TEST_CASE("sampler: shuffled ranks cover the dataset, disjoint apart from padding", "[sampler]") {
  for (std::uint64_t n : {1u, 2u, 7u, 64u, 100u, 1000u, 1025u}) {
    for (int world : {1, 2, 3, 8}) {
      for (bool drop_last : {false, true}) {
        INFO("n=" << n << " world=" << world << " drop_last=" << drop_last);
        const auto ranks = all_ranks(n, world, {.shuffle = true, .seed = 17, .drop_last = drop_last}, 3);
        std::map<std::uint64_t, int> seen;
        for (const auto& mine : ranks) {
          CHECK(mine.size() == ranks[0].size());  // equal lengths
          for (auto index : mine) {
            REQUIRE(index < n);
            ++seen[index];
          }
        }
        const std::uint64_t total = ranks[0].size() * static_cast<std::uint64_t>(world);
        if (drop_last) {
          CHECK(total == n - n % static_cast<std::uint64_t>(world));
          CHECK(seen.size() == total);  // nothing repeated
        } else {
          CHECK(total == (n + static_cast<std::uint64_t>(world) - 1) / static_cast<std::uint64_t>(world) *
                             static_cast<std::uint64_t>(world));
          CHECK(seen.size() == n);  // every index appears
          std::uint64_t repeats = 0;
          for (auto& [index, count] : seen) repeats += static_cast<std::uint64_t>(count - 1);
          CHECK(repeats == total - n);  // only the padding repeats
        }
      }
    }
  }
}

TEST_CASE("sampler: padding wraps the shuffled list from its start", "[sampler]") {
  // With shuffle on, padded position p holds the shuffled list's element p mod n; world 1
  // reveals the whole shuffled list, from which the padded assignment must follow.
  const std::uint64_t n = 10;
  const int world = 4;
  cohort::distributed_sampler whole{n, 1, 0, {.shuffle = true, .seed = 5}};
  whole.set_epoch(2);
  const auto shuffled = whole.indices();
  const auto ranks = all_ranks(n, world, {.shuffle = true, .seed = 5}, 2);
  for (int rank = 0; rank < world; ++rank) {
    index_list expected;
    for (std::uint64_t p = static_cast<std::uint64_t>(rank); p < 12; p += world) expected.push_back(shuffled[p % n]);
    CHECK(ranks[static_cast<std::size_t>(rank)] == expected);
  }
}

TEST_CASE("sampler: same seed and epoch repeat the order, a new epoch or seed changes it", "[sampler]") {
  const std::uint64_t n = 5000;
  const auto first = all_ranks(n, 4, {.shuffle = true, .seed = 42}, 7);
  const auto again = all_ranks(n, 4, {.shuffle = true, .seed = 42}, 7);
  CHECK(first == again);

  const auto next_epoch = all_ranks(n, 4, {.shuffle = true, .seed = 42}, 8);
  const auto other_seed = all_ranks(n, 4, {.shuffle = true, .seed = 43}, 7);
  CHECK(first != next_epoch);
  CHECK(first != other_seed);

  // Not merely different: the orders share few positions (a random pair shares ~1).
  std::size_t same_position = 0;
  for (std::size_t rank = 0; rank < first.size(); ++rank)
    for (std::size_t j = 0; j < first[rank].size(); ++j) same_position += first[rank][j] == next_epoch[rank][j] ? 1 : 0;
  CHECK(same_position < 20);

  // A shuffled order is not the identity.
  const auto whole = all_ranks(n, 1, {.shuffle = true, .seed = 42}, 7)[0];
  std::size_t fixed_points = 0;
  for (std::size_t j = 0; j < whole.size(); ++j) fixed_points += whole[j] == j ? 1 : 0;
  CHECK(fixed_points < 20);
}

TEST_CASE("sampler: the Feistel permutation is a bijection for many sizes", "[sampler]") {
  for (std::uint64_t n = 1; n <= 300; ++n) {
    for (std::uint64_t epoch : {0u, 1u}) {
      cohort::detail::feistel_permutation permutation{n, 9, epoch};
      std::vector<char> hit(n, 0);
      for (std::uint64_t i = 0; i < n; ++i) {
        const auto value = permutation(i);
        REQUIRE(value < n);
        REQUIRE(hit[value] == 0);
        hit[value] = 1;
      }
    }
  }
  for (std::uint64_t n : {65536u, 65537u, 100003u}) {
    cohort::detail::feistel_permutation permutation{n, 1234, 5};
    std::vector<char> hit(n, 0);
    for (std::uint64_t i = 0; i < n; ++i) {
      const auto value = permutation(i);
      REQUIRE(value < n);
      REQUIRE(hit[value] == 0);
      hit[value] = 1;
    }
  }
}

TEST_CASE("sampler: huge datasets cost nothing up front", "[sampler]") {
  const std::uint64_t n = std::uint64_t{1} << 40;  // a trillion samples: no vector of them
  cohort::distributed_sampler sampler{n, 1024, 1000, {.shuffle = true, .seed = 3}};
  CHECK(sampler.size() == n / 1024);
  std::set<std::uint64_t> first_thousand;
  for (std::uint64_t j = 0; j < 1000; ++j) {
    const auto index = sampler[j];
    REQUIRE(index < n);
    first_thousand.insert(index);
  }
  CHECK(first_thousand.size() == 1000);
  CHECK(sampler.at(sampler.size() - 1) < n);
  CHECK_THROWS_AS(sampler.at(sampler.size()), cohort::error);
}

TEST_CASE("sampler: a second pass without set_epoch warns exactly once", "[sampler]") {
  std::vector<std::string> warnings;
  auto collect = [&](std::string_view message) { warnings.emplace_back(message); };
  cohort::distributed_sampler sampler{100, 2, 1, {.shuffle = true, .seed = 0, .warn = collect}};

  sampler.set_epoch(0);
  for ([[maybe_unused]] auto index : sampler) {}
  sampler.set_epoch(1);
  (void)sampler.indices();
  CHECK(warnings.empty());  // set_epoch between passes: fine

  (void)sampler.indices();  // epoch 1 again: the bug
  REQUIRE(warnings.size() == 1);
  CHECK(warnings[0].find("set_epoch") != std::string::npos);
  CHECK(warnings[0].find("[rank 1]") != std::string::npos);

  for ([[maybe_unused]] auto index : sampler) {}
  sampler.set_epoch(2);
  (void)sampler.indices();
  (void)sampler.indices();
  CHECK(warnings.size() == 1);  // once per sampler, not once per repeat

  // Without shuffling every pass is meant to be the same: no warning.
  std::vector<std::string> quiet;
  cohort::distributed_sampler ordered{
      100, 2, 0, {.shuffle = false, .warn = [&](std::string_view m) { quiet.emplace_back(m); }}};
  (void)ordered.indices();
  (void)ordered.indices();
  CHECK(quiet.empty());

  // Random access does not count as a pass.
  std::vector<std::string> none;
  cohort::distributed_sampler random_access{
      100, 2, 0, {.shuffle = true, .warn = [&](std::string_view m) { none.emplace_back(m); }}};
  for (int pass = 0; pass < 3; ++pass)
    for (std::uint64_t j = 0; j < random_access.size(); ++j) (void)random_access[j];
  CHECK(none.empty());
}

TEST_CASE("sampler: built from a group, and rejects impossible ranks", "[sampler]") {
  fake_group group{2, 3};
  cohort::distributed_sampler from_group{10, group, {.shuffle = false}};
  CHECK(from_group.rank() == 2);
  CHECK(from_group.world_size() == 3);
  CHECK(from_group.indices() == torch_assignment(10, 3, 2, false));

  CHECK_THROWS_AS((cohort::distributed_sampler{10, 0, 0}), cohort::error);
  CHECK_THROWS_AS((cohort::distributed_sampler{10, 4, 4}), cohort::error);
  CHECK_THROWS_AS((cohort::distributed_sampler{10, 4, -1}), cohort::error);
  try {
    cohort::distributed_sampler bad{10, 4, 7};
    FAIL("expected an error");
  } catch (const cohort::error& e) {
    CHECK(std::string(e.what()).find("rank 7") != std::string::npos);
  }
}

TEST_CASE("sampler: is_padding marks exactly the duplicates, the rest is the dataset once", "[sampler]") {
  for (std::uint64_t n : {0u, 1u, 2u, 7u, 100u, 101u}) {
    for (int world : {1, 2, 3, 4, 8}) {
      for (bool shuffle : {false, true}) {
        for (bool drop_last : {false, true}) {
          for (bool even_batches : {true, false}) {
            INFO("n=" << n << " world=" << world << " shuffle=" << shuffle << " drop_last=" << drop_last
                      << " even_batches=" << even_batches);
            const cohort::sampler_options options{
                .shuffle = shuffle, .seed = 11, .drop_last = drop_last, .even_batches = even_batches};
            const auto w = static_cast<std::uint64_t>(world);
            std::map<std::uint64_t, int> real_seen;
            std::uint64_t positions = 0;
            for (int rank = 0; rank < world; ++rank) {
              cohort::distributed_sampler sampler{n, world, rank, options};
              sampler.set_epoch(4);
              const auto mine = sampler.indices();
              positions += mine.size();
              CHECK(sampler.unpadded_size() <= sampler.size());
              for (std::uint64_t j = 0; j < mine.size(); ++j) {
                // Padding is the tail of each rank's list, at the positions past the dataset.
                CHECK(sampler.is_padding(j) == (j >= sampler.unpadded_size()));
                CHECK(sampler.is_padding(j) == (sampler.epoch_position(j) >= n));
                if (!sampler.is_padding(j)) ++real_seen[mine[j]];
              }
              CHECK_FALSE(sampler.is_padding(sampler.size()));  // past the end: not a position at all
              if (!even_batches && !drop_last) {
                // The true share: ranks below the remainder read one more, nothing is padded.
                CHECK(sampler.size() == n / w + (static_cast<std::uint64_t>(rank) < n % w ? 1 : 0));
                CHECK(sampler.unpadded_size() == sampler.size());
                CHECK(sampler.total_size() == n);
              }
            }
            {
              cohort::distributed_sampler any_rank{n, world, 0, options};
              CHECK(positions == any_rank.total_size());
            }
            for (const auto& [index, count] : real_seen) {
              CHECK(index < n);
              CHECK(count == 1);  // no real sample twice
            }
            CHECK(real_seen.size() == (drop_last ? n - n % w : n));  // drop_last drops the tail only
          }
        }
      }
    }
  }
}

namespace {

// Micro-batch mode's expected assignment, written from its definition on the world-1 order of
// the plain sampler (the epoch's list): rank r reads, step by step, micro-batches
// [r M / world, (r + 1) M / world), micro-batch i of step s being list positions
// [s M b + i b, +b), wrapped past the list's end.
index_list micro_batch_assignment(const index_list& list, std::uint64_t steps, std::uint64_t micro_batches,
                                  std::uint64_t size, int world, int rank) {
  const std::uint64_t per_rank = micro_batches / static_cast<std::uint64_t>(world);
  index_list mine;
  for (std::uint64_t step = 0; step < steps; ++step)
    for (std::uint64_t i = static_cast<std::uint64_t>(rank) * per_rank;
         i < (static_cast<std::uint64_t>(rank) + 1) * per_rank; ++i)
      for (std::uint64_t o = 0; o < size; ++o)
        mine.push_back(list[(step * micro_batches * size + i * size + o) % list.size()]);
  return mine;
}

}  // namespace

TEST_CASE("sampler: micro-batch mode gives micro-batch i the same samples at any world size, each rank a run",
          "[sampler]") {
  // 100 samples in global steps of 8 x 3: 4 whole steps and a tail of 4 samples.
  const std::uint64_t n = 100, micro_batches = 8, size = 3;
  for (bool shuffle : {false, true}) {
    for (bool drop_last : {false, true}) {
      cohort::distributed_sampler plain{n, 1, 0, {.shuffle = shuffle, .seed = 31}};
      plain.set_epoch(2);
      const index_list list = plain.indices();  // the epoch's order, the Feistel permutation's
      const std::uint64_t steps = drop_last ? 4 : 5;
      for (int world : {1, 2, 4, 8}) {
        for (int rank = 0; rank < world; ++rank) {
          INFO("shuffle=" << shuffle << " drop_last=" << drop_last << " world=" << world << " rank=" << rank);
          cohort::distributed_sampler sampler{n,
                                              world,
                                              rank,
                                              {.shuffle = shuffle,
                                               .seed = 31,
                                               .drop_last = drop_last,
                                               .micro_batches = micro_batches,
                                               .micro_batch_size = size}};
          sampler.set_epoch(2);
          CHECK(sampler.micro_batches_per_rank() == micro_batches / static_cast<std::uint64_t>(world));
          CHECK(sampler.global_steps() == steps);
          CHECK(sampler.size() == steps * sampler.micro_batches_per_rank() * size);
          CHECK(sampler.total_size() == steps * micro_batches * size);
          CHECK(sampler.indices() == micro_batch_assignment(list, steps, micro_batches, size, world, rank));
          // The device rule (index_map) and random access agree with the materialized list.
          const auto map = sampler.index_map();
          for (std::uint64_t j = 0; j < sampler.size(); ++j) REQUIRE(map(j) == sampler[j]);
        }
      }
    }
  }
}

TEST_CASE("sampler: micro-batch mode pads the last global step by wrapping, or drop_last drops it", "[sampler]") {
  // 100 samples, steps of 8 x 3 = 24: the fifth step holds positions 96..99 and 20 of padding.
  const std::uint64_t n = 100;
  for (int world : {1, 2, 4}) {
    std::map<std::uint64_t, int> real_seen;
    std::uint64_t padding = 0;
    for (int rank = 0; rank < world; ++rank) {
      INFO("world=" << world << " rank=" << rank);
      cohort::distributed_sampler sampler{n, world, rank, {.seed = 4, .micro_batches = 8, .micro_batch_size = 3}};
      const auto mine = sampler.indices();
      for (std::uint64_t j = 0; j < mine.size(); ++j) {
        CHECK(sampler.is_padding(j) == (sampler.epoch_position(j) >= n));
        CHECK(sampler.is_padding(j) == (j >= sampler.unpadded_size()));
        if (sampler.is_padding(j))
          ++padding;
        else
          ++real_seen[mine[j]];
      }
      // Rank 0 holds the tail's 4 real samples at 4 ranks (its run is 6 long); ranks past it hold padding only.
      if (world == 4) CHECK(sampler.unpadded_size() == 4 * 6 + (rank == 0 ? 4 : 0));
    }
    CHECK(padding == 20);
    CHECK(real_seen.size() == n);  // every sample once, the padding aside
    for (const auto& [index, count] : real_seen) CHECK(count == 1);

    std::uint64_t kept = 0;
    for (int rank = 0; rank < world; ++rank) {
      cohort::distributed_sampler dropping{
          n, world, rank, {.seed = 4, .drop_last = true, .micro_batches = 8, .micro_batch_size = 3}};
      kept += dropping.size();
      CHECK(dropping.unpadded_size() == dropping.size());
    }
    CHECK(kept == 96);  // the incomplete fifth step dropped whole
  }
}

TEST_CASE("sampler: micro-batch mode refuses micro-batches the world does not divide, naming the rule", "[sampler]") {
  try {
    cohort::distributed_sampler sampler{100, 4, 3, {.micro_batches = 6, .micro_batch_size = 2}};
    FAIL("expected an error");
  } catch (const cohort::error& e) {
    const std::string what = e.what();
    CHECK(what.find("rank 3") != std::string::npos);
    CHECK(what.find("6 micro-batches per step over 4 ranks") != std::string::npos);
    CHECK(what.find("multiple of the world size") != std::string::npos);
  }
  CHECK_THROWS_AS((cohort::distributed_sampler{100, 2, 0, {.micro_batches = 6}}), cohort::error);
  CHECK_THROWS_AS((cohort::distributed_sampler{100, 2, 0, {.micro_batch_size = 6}}), cohort::error);
  CHECK_THROWS_AS(
      (cohort::distributed_sampler{100, 2, 0, {.even_batches = false, .micro_batches = 6, .micro_batch_size = 2}}),
      cohort::error);
  CHECK_NOTHROW(cohort::distributed_sampler{100, 3, 0, {.micro_batches = 6, .micro_batch_size = 2}});
}

TEST_CASE("sampler: even_batches off reads the padded assignment minus its padding", "[sampler]") {
  // The same positions r, r + world, ... as torch's rule, so switching the option changes no
  // sample's rank: the uneven list is the even list's non-padding prefix.
  for (bool shuffle : {false, true}) {
    for (int rank = 0; rank < 4; ++rank) {
      cohort::distributed_sampler even{101, 4, rank, {.shuffle = shuffle, .seed = 2}};
      cohort::distributed_sampler uneven{101, 4, rank, {.shuffle = shuffle, .seed = 2, .even_batches = false}};
      auto expected = even.indices();
      expected.resize(static_cast<std::size_t>(even.unpadded_size()));
      CHECK(uneven.indices() == expected);
      CHECK(uneven.size() == (rank == 0 ? 26u : 25u));  // 101 = 4 x 25 + 1
    }
  }
  cohort::distributed_sampler first{101, 4, 0, {.shuffle = false}};
  cohort::distributed_sampler last{101, 4, 3, {.shuffle = false}};
  CHECK(first.unpadded_size() == 26);
  CHECK(last.unpadded_size() == 25);
  CHECK(last.size() == 26);
  CHECK(last.is_padding(25));
  CHECK(last[25] == 2);  // position 3 + 25 x 4 = 103 wraps to the list's element 103 - 101
}

TEST_CASE("sampler: on Gloo ranks the non-padding indices are the dataset exactly once", "[sampler][gloo]") {
#if __has_include(<gloo/context.h>)
  const std::uint64_t n = 101;
  for (int world : {3, 4}) {
    for (bool shuffle : {false, true}) {
      for (bool drop_last : {false, true}) {
        for (bool even_batches : {true, false}) {
          INFO("world=" << world << " shuffle=" << shuffle << " drop_last=" << drop_last
                        << " even_batches=" << even_batches);
          auto store = std::make_shared<cohort::memory_store>();
          std::vector<std::vector<std::int64_t>> real_by_rank(static_cast<std::size_t>(world));
          cohort_test::run_ranks(world, [&](int rank) {
            cohort::gloo::options opts;
            opts.timeout = std::chrono::seconds(20);
            cohort::process_group<cohort::gloo> pg{store, cohort::launch_env::explicit_ranks(rank, world), opts};
            cohort::distributed_sampler sampler{
                n, pg, {.shuffle = shuffle, .seed = 5, .drop_last = drop_last, .even_batches = even_batches}};
            sampler.set_epoch(1);
            std::vector<std::int64_t> real;
            std::uint64_t j = 0;
            for (auto index : sampler) {
              if (!sampler.is_padding(j++)) real.push_back(static_cast<std::int64_t>(index));
            }
            // Each rank learns every rank's count, then the real indices, padded with -1 to
            // the longest list so one all_gather carries them.
            std::vector<std::int64_t> count{static_cast<std::int64_t>(real.size())};
            std::vector<std::int64_t> counts(static_cast<std::size_t>(world));
            pg.all_gather(count, counts).wait();
            const auto longest = static_cast<std::size_t>(*std::max_element(counts.begin(), counts.end()));
            real.resize(longest, -1);
            std::vector<std::int64_t> all(longest * static_cast<std::size_t>(world));
            pg.all_gather(real, all).wait();
            if (rank == 0) {
              for (int r = 0; r < world; ++r) {
                const auto first = all.begin() + static_cast<std::ptrdiff_t>(longest) * r;
                real_by_rank[static_cast<std::size_t>(r)].assign(first, first + counts[static_cast<std::size_t>(r)]);
              }
            }
          });
          std::map<std::int64_t, int> seen;
          for (const auto& real : real_by_rank)
            for (auto index : real) ++seen[index];
          const std::uint64_t expected_count = drop_last ? n - n % static_cast<std::uint64_t>(world) : n;
          CHECK(seen.size() == expected_count);
          bool each_once = true;
          for (const auto& [index, times] : seen) each_once = each_once && times == 1 && index >= 0 && index < 101;
          CHECK(each_once);
          if (!drop_last && !even_batches) {
            // 101 over 3: 34, 34, 33; over 4: 26, 25, 25, 25.
            CHECK(real_by_rank[0].size() == (world == 3 ? 34u : 26u));
            CHECK(real_by_rank.back().size() == (world == 3 ? 33u : 25u));
          }
        }
      }
    }
  }
#else
  cohort_test::skip("built without Gloo (apt-get install libgloo-dev)");
#endif
}

TEST_CASE("sampler: on 3 Gloo ranks the gathered slices cover the dataset", "[sampler][gloo]") {
#if __has_include(<gloo/context.h>)
  const std::uint64_t n = 1001;
  const int world = 3;
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::vector<std::int64_t>> gathered(world);
  cohort_test::run_ranks(world, [&](int rank) {
    cohort::gloo::options opts;
    opts.timeout = std::chrono::seconds(20);
    cohort::process_group<cohort::gloo> pg{store, cohort::launch_env::explicit_ranks(rank, world), opts};
    cohort::distributed_sampler sampler{n, pg, {.shuffle = true, .seed = 8}};
    sampler.set_epoch(2);
    const auto mine = sampler.indices();
    std::vector<std::int64_t> in(mine.begin(), mine.end());
    std::vector<std::int64_t> all(in.size() * static_cast<std::size_t>(world));
    pg.all_gather(std::span<const std::int64_t>(in), std::span<std::int64_t>(all)).wait();
    gathered[static_cast<std::size_t>(rank)] = all;
  });
  // Every rank gathered the same thing, and it is exactly what the host computes rank by rank.
  CHECK(gathered[1] == gathered[0]);
  CHECK(gathered[2] == gathered[0]);
  std::vector<std::int64_t> expected;
  for (const auto& slice : all_ranks(n, world, {.shuffle = true, .seed = 8}, 2))
    expected.insert(expected.end(), slice.begin(), slice.end());
  CHECK(gathered[0] == expected);
  std::set<std::int64_t> distinct(gathered[0].begin(), gathered[0].end());
  CHECK(distinct.size() == n);                                   // coverage
  CHECK(gathered[0].size() == (n + world - 1) / world * world);  // padded to a multiple of world
#else
  cohort_test::skip("built without Gloo (apt-get install libgloo-dev)");
#endif
}
