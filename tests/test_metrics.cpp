// gather_for_metrics and split_between_processes: evaluation over real Gloo ranks counts every
// sample once, in dataset order, and a bad input fails on every rank instead of hanging.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "cohort/data/metrics.hpp"
#include "cohort/data/sampler.hpp"
#include "support.hpp"

#if __has_include(<gloo/context.h>)
#include "cohort/comm/gloo.hpp"
#include "cohort/comm/process_group.hpp"
#endif

namespace {

// A fixed "model" and its labels: whether it is right about sample i is a pure function of i,
// so the single-process accuracy is computed here without any rank.
std::uint8_t label(std::uint64_t index) { return static_cast<std::uint8_t>((index * 7 + 3) % 5); }
std::uint8_t prediction(std::uint64_t index) { return static_cast<std::uint8_t>((index * index) % 5); }
std::uint8_t correct(std::uint64_t index) { return prediction(index) == label(index) ? 1 : 0; }

std::uint64_t single_process_correct(std::uint64_t n) {
  std::uint64_t right = 0;
  for (std::uint64_t i = 0; i < n; ++i) right += correct(i);
  return right;
}

struct fake_group {
  int my_rank, my_size;
  int rank() const { return my_rank; }
  int world_size() const { return my_size; }
};

// A per-sample value that is not a cohort element: gathered as bytes.
struct scored_sample {
  std::uint64_t index;
  float score;
  bool operator==(const scored_sample&) const = default;
};

#if __has_include(<gloo/context.h>)
using gloo_group = cohort::process_group<cohort::gloo>;

// fn(pg) on `world` Gloo ranks of a fresh store, with a timeout short enough that a hang
// would fail the test quickly.
template <class Fn>
void on_gloo_ranks(int world, Fn&& fn) {
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    cohort::gloo::options opts;
    opts.timeout = std::chrono::seconds(20);
    gloo_group pg{store, cohort::launch_env::explicit_ranks(rank, world), opts};
    fn(pg);
  });
}
#endif

}  // namespace

TEST_CASE("split_between_processes: even slices, remainder first, padding repeats the slice's last", "[metrics]") {
  for (int world : {1, 2, 3, 4, 7}) {
    const auto w = static_cast<std::uint64_t>(world);
    for (std::uint64_t n : {std::uint64_t{0}, std::uint64_t{1}, w - 1, w, std::uint64_t{101}}) {
      for (bool pad : {false, true}) {
        INFO("n=" << n << " world=" << world << " pad=" << pad);
        std::uint64_t next = 0;
        const std::uint64_t longest = (n + w - 1) / w;
        for (int rank = 0; rank < world; ++rank) {
          const auto slice = cohort::split_between_processes(n, world, rank, pad);
          const auto r = static_cast<std::uint64_t>(rank);
          CHECK(slice.begin == next);  // contiguous, in rank order
          CHECK(slice.size() == n / w + (r < n % w ? 1 : 0));
          CHECK(slice.range_size == n);
          next = slice.end;
          CHECK(slice.padded_size == (pad ? longest : slice.size()));
          CHECK(slice.padded == (pad && slice.size() < longest));
          CHECK(slice.padding() == slice.padded_size - slice.size());
          for (std::uint64_t j = 0; j < slice.padded_size; ++j) {
            CHECK(slice.is_padding(j) == (j >= slice.size()));
            CHECK(slice[j] < n);  // even a padded empty slice repeats a real element
          }
          if (slice.padded) {
            CHECK(slice.repeated == slice.end - 1);
            CHECK(slice[slice.padded_size - 1] == slice.repeated);
          }
          const fake_group group{rank, world};
          const auto from_group = cohort::split_between_processes(n, group, pad);
          CHECK(from_group.begin == slice.begin);
          CHECK(from_group.end == slice.end);
          CHECK(from_group.padded_size == slice.padded_size);
        }
        CHECK(next == n);  // the slices tile the range
      }
    }
  }
  // 101 over 4: 26, 25, 25, 25; padded, ranks 1..3 repeat their last element once.
  const auto second = cohort::split_between_processes(101, 4, 1, true);
  CHECK(second.begin == 26);
  CHECK(second.end == 51);
  CHECK(second.padded_size == 26);
  CHECK(second.repeated == 50);
  // 1 over 3, padded: ranks 1 and 2 have nothing of their own and repeat element 0.
  const auto empty = cohort::split_between_processes(1, 3, 2, true);
  CHECK(empty.size() == 0);
  CHECK(empty.padded);
  CHECK(empty.repeated == 0);
  CHECK_THROWS_AS(cohort::split_between_processes(10, 0, 0), cohort::error);
  CHECK_THROWS_AS(cohort::split_between_processes(10, 3, 3), cohort::error);
}

TEST_CASE("gather_for_metrics: counts too large for the wire are refused the same way on every rank", "[metrics]") {
  // The verdict is a pure function of the claims every rank holds after the first all_gather,
  // so checking it directly on each "rank" checks that they all throw the same error.
  using cohort::detail::metrics_claim;
  using cohort::detail::metrics_layout;
  const std::int64_t huge = std::int64_t{1} << 61;  // each fits the wire; three of 8 bytes do not fit memory
  for (int rank = 0; rank < 3; ++rank) {
    std::vector<metrics_claim> claims(3);
    for (auto& c : claims) {
      c.count = huge;
      c.keep = huge;
      c.agreed = 3 * huge;
    }
    try {
      cohort::detail::check_metrics_claims(rank, claims, 8, metrics_layout::rank_order);
      FAIL("expected an error");
    } catch (const cohort::error& e) {
      const std::string text = e.what();
      INFO(text);
      CHECK(e.rank() == rank);
      CHECK(text.find("would need 3 x 2305843009213693952 x 8 bytes") != std::string::npos);
      CHECK(text.find("hint") != std::string::npos);
    }
    // A rank whose own count could not be put on the wire says so for everyone.
    std::vector<metrics_claim> one_bad(3);
    one_bad[2].count = -1;
    one_bad[2].problem = static_cast<std::int64_t>(cohort::detail::metrics_problem::too_many_values);
    try {
      cohort::detail::check_metrics_claims(rank, one_bad, 16, metrics_layout::rank_order);
      FAIL("expected an error");
    } catch (const cohort::error& e) {
      const std::string text = e.what();
      INFO(text);
      CHECK(text.find("rank 2 passed more values than a 64-bit count of bytes can hold") != std::string::npos);
    }
  }
}

TEST_CASE("gather_for_metrics: sampler accuracy over 101 samples equals the single-process accuracy",
          "[metrics][gloo]") {
#if __has_include(<gloo/context.h>)
  const std::uint64_t n = 101;
  const std::uint64_t expected_right = single_process_correct(n);
  REQUIRE(expected_right > 0);
  REQUIRE(expected_right < n);
  for (int world : {2, 3, 4}) {
    for (bool even_batches : {true, false}) {
      INFO("world=" << world << " even_batches=" << even_batches);
      const cohort::sampler_options options{
          .shuffle = true, .seed = 21, .drop_last = false, .even_batches = even_batches};
      // The epoch's shuffled list, as one process reads it: the order the result must follow.
      cohort::distributed_sampler whole{n, 1, 0, options};
      whole.set_epoch(3);
      const auto epoch_order = whole.indices();
      on_gloo_ranks(world, [&](gloo_group& pg) {
        cohort::distributed_sampler sampler{n, pg, options};
        sampler.set_epoch(3);
        std::vector<std::uint8_t> right;
        std::vector<std::uint64_t> read;
        for (auto index : sampler) {
          right.push_back(correct(index));
          read.push_back(index);
        }
        const auto gathered = cohort::gather_for_metrics(pg, right, sampler);
        RANK_CHECK(gathered.size() == n, "got " << gathered.size());
        const auto sum = std::accumulate(gathered.begin(), gathered.end(), std::uint64_t{0});
        const double accuracy = static_cast<double>(sum) / static_cast<double>(gathered.size());
        const double single = static_cast<double>(expected_right) / static_cast<double>(n);
        RANK_CHECK(accuracy == single, "distributed " << accuracy << ", single process " << single);

        // Which index each value belongs to: the epoch's order, padding gone.
        const auto indices = cohort::gather_for_metrics(pg, read, sampler);
        RANK_CHECK(indices == epoch_order);

        // Only the real values, to rank 0 only: the same result there, nothing elsewhere.
        std::vector<std::uint64_t> real(read.begin(),
                                        read.begin() + static_cast<std::ptrdiff_t>(sampler.unpadded_size()));
        const auto on_zero = cohort::gather_for_metrics(pg, real, sampler, cohort::gather_destination::rank_zero);
        if (pg.rank() == 0)
          RANK_CHECK(on_zero == epoch_order);
        else
          RANK_CHECK(on_zero.empty());

        // The trap this avoids: gathering everything the ranks read counts the padding too.
        if (even_batches) {
          std::vector<std::uint8_t> all(right.size() * static_cast<std::size_t>(pg.size()));
          pg.all_gather(right, all).wait();
          RANK_CHECK(all.size() == sampler.total_size());
          RANK_CHECK(all.size() > n || n % static_cast<std::uint64_t>(pg.size()) == 0);
        }
      });
    }
  }
#else
  cohort_test::skip("built without Gloo (apt-get install libgloo-dev)");
#endif
}

TEST_CASE("gather_for_metrics: spans of different lengths per rank, in rank order, cut at the true count",
          "[metrics][gloo]") {
#if __has_include(<gloo/context.h>)
  struct scenario {
    std::vector<std::uint64_t> lengths;
    std::uint64_t total;
  };
  const std::vector<scenario> scenarios = {
      {{50, 0, 51}, 101},                       // a rank with nothing
      {{34, 34, 34}, 101},                      // the last rank's final value is padding at the dataset's end
      {{26, 25, 25, 25}, 101},                  // exactly the dataset
      {{1, 100}, 101},         {{0, 0, 0}, 0},  // nothing at all
  };
  for (const auto& s : scenarios) {
    const int world = static_cast<int>(s.lengths.size());
    INFO("world=" << world << " total=" << s.total);
    for (auto to : {cohort::gather_destination::every_rank, cohort::gather_destination::rank_zero}) {
      on_gloo_ranks(world, [&](gloo_group& pg) {
        const auto rank = static_cast<std::size_t>(pg.rank());
        std::uint64_t first = 0;
        for (std::size_t r = 0; r < rank; ++r) first += s.lengths[r];
        std::vector<scored_sample> mine;
        for (std::uint64_t i = first; i < first + s.lengths[rank]; ++i)
          mine.push_back({i, static_cast<float>(i) * 0.5f});
        const auto gathered = cohort::gather_for_metrics(pg, std::span<const scored_sample>(mine), s.total, to);
        if (to == cohort::gather_destination::rank_zero && pg.rank() != 0) {
          RANK_CHECK(gathered.empty());
          return;
        }
        RANK_CHECK(gathered.size() == s.total, "got " << gathered.size());
        for (std::uint64_t i = 0; i < gathered.size(); ++i)
          RANK_CHECK((gathered[i] == scored_sample{i, static_cast<float>(i) * 0.5f}), "at " << i);
      });
    }
  }
#else
  cohort_test::skip("built without Gloo (apt-get install libgloo-dev)");
#endif
}

TEST_CASE("gather_for_metrics: split_between_processes slices, padded or not, come back in range order",
          "[metrics][gloo]") {
#if __has_include(<gloo/context.h>)
  for (int world : {2, 3, 4}) {
    const auto w = static_cast<std::uint64_t>(world);
    for (std::uint64_t n : {std::uint64_t{0}, std::uint64_t{1}, w - 1, std::uint64_t{101}}) {
      for (bool pad : {false, true}) {
        INFO("n=" << n << " world=" << world << " pad=" << pad);
        on_gloo_ranks(world, [&](gloo_group& pg) {
          const auto slice = cohort::split_between_processes(n, pg, pad);
          std::vector<std::int32_t> squares;
          for (std::uint64_t j = 0; j < slice.padded_size; ++j)
            squares.push_back(static_cast<std::int32_t>(slice[j] * slice[j]));
          const auto gathered = cohort::gather_for_metrics(pg, squares, slice);
          RANK_CHECK(gathered.size() == n, "got " << gathered.size());
          for (std::uint64_t i = 0; i < gathered.size(); ++i)
            RANK_CHECK(gathered[i] == static_cast<std::int32_t>(i * i), "at " << i);
        });
      }
    }
  }
#else
  cohort_test::skip("built without Gloo (apt-get install libgloo-dev)");
#endif
}

TEST_CASE("gather_for_metrics: a wrong length on one rank fails on every rank, naming it", "[metrics][gloo]") {
#if __has_include(<gloo/context.h>)
  const int world = 3;
  auto expect_every_rank_fails = [&](const std::string& needle, auto&& call) {
    std::vector<std::string> messages(world);
    const auto started = std::chrono::steady_clock::now();
    on_gloo_ranks(world, [&](gloo_group& pg) {
      messages[static_cast<std::size_t>(pg.rank())] = RANK_CHECK_THROWS(cohort::error, call(pg), needle);
      // The group still works afterwards: nobody is stuck in a half-finished collective.
      std::vector<std::int64_t> one{1};
      pg.all_reduce(one).wait();
      RANK_CHECK(one[0] == world);
    });
    const auto elapsed = std::chrono::steady_clock::now() - started;
    CHECK(elapsed < std::chrono::seconds(10));  // far below the 20 s timeout: no rank waited it out
    for (int rank = 0; rank < world; ++rank) {
      INFO(messages[static_cast<std::size_t>(rank)]);
      CHECK(messages[static_cast<std::size_t>(rank)].find("[rank " + std::to_string(rank) + "]") != std::string::npos);
      CHECK(messages[static_cast<std::size_t>(rank)].find("gather_for_metrics") != std::string::npos);
      CHECK(messages[static_cast<std::size_t>(rank)].find("hint") != std::string::npos);
    }
  };

  SECTION("more values than the sampler gave that rank") {
    expect_every_rank_fails("rank 1 passed 35 values, but its sampler gave it 34 indices", [](gloo_group& pg) {
      cohort::distributed_sampler sampler{101, pg, {.shuffle = true}};
      std::vector<float> values(sampler.size() + (pg.rank() == 1 ? 1 : 0), 1.0f);
      return cohort::gather_for_metrics(pg, values, sampler);
    });
  }
  SECTION("fewer values than a slice holds") {
    expect_every_rank_fails("rank 2 passed 10 values, but its slice holds 33", [](gloo_group& pg) {
      const auto slice = cohort::split_between_processes(101, pg);
      std::vector<double> values(pg.rank() == 2 ? 10 : slice.size(), 0.0);
      return cohort::gather_for_metrics(pg, values, slice);
    });
  }
  SECTION("fewer values in all than the true count") {
    expect_every_rank_fails("the ranks passed 30 values in all (rank 0: 10, rank 1: 10, rank 2: 10)",
                            [](gloo_group& pg) {
                              std::vector<std::int64_t> values(10, 7);
                              return cohort::gather_for_metrics(pg, values, std::uint64_t{101});
                            });
  }
  SECTION("ranks that disagree on the dataset") {
    expect_every_rank_fails("rank 0 passed a total count of 30 but rank 2 passed 31", [](gloo_group& pg) {
      std::vector<std::int64_t> values(10, 7);
      return cohort::gather_for_metrics(pg, values, std::uint64_t{pg.rank() == 2 ? 31u : 30u});
    });
  }
  SECTION("samplers built with different options") {
    expect_every_rank_fails("the ranks' samplers disagree", [](gloo_group& pg) {
      // Rank 0 drops the tail, the others pad: their positions no longer fit together.
      cohort::distributed_sampler sampler{101, pg, {.shuffle = false, .drop_last = pg.rank() == 0}};
      std::vector<float> values(sampler.size(), 1.0f);
      return cohort::gather_for_metrics(pg, values, sampler);
    });
  }
  SECTION("a sampler of another group") {
    expect_every_rank_fails("rank 1's sampler was built for rank 0 of a world of 2", [](gloo_group& pg) {
      cohort::distributed_sampler sampler{101, pg.rank() == 1 ? 2 : pg.size(), pg.rank() == 1 ? 0 : pg.rank()};
      std::vector<float> values(sampler.size(), 1.0f);
      return cohort::gather_for_metrics(pg, values, sampler);
    });
  }
  SECTION("a sampler in micro-batch mode on one rank") {
    // Its positions are runs, not r + j * world: placing them so would scramble the result.
    expect_every_rank_fails("rank 1's sampler is in micro-batch mode (3 micro-batches per step)", [](gloo_group& pg) {
      cohort::distributed_sampler sampler{
          101,
          pg,
          {.shuffle = false, .micro_batches = pg.rank() == 1 ? 3u : 0u, .micro_batch_size = pg.rank() == 1 ? 2u : 0u}};
      std::vector<float> values(sampler.size(), 1.0f);
      return cohort::gather_for_metrics(pg, values, sampler);
    });
  }
#else
  cohort_test::skip("built without Gloo (apt-get install libgloo-dev)");
#endif
}
