// process_group<gloo>: every collective x dtype x op on 2, 3 and 4 ranks (threads, each
// with its own Gloo context over loopback; the bulk collectives through shared memory, or,
// as test_process_group_tcp, over TCP), against expectations computed here
// independently; then the faults: a rank that never arrives, a rank that dies, mismatched
// sizes, collectives inside on_main; then the conveniences: collectives on any contiguous
// range, stream-ordered calls (pg.on(stream)) and one host value across ranks.
#include <catch2/catch.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cohort/comm/gloo.hpp>
#include <cohort/comm/host_values.hpp>
#include <cohort/comm/ops.hpp>
#include <cohort/comm/process_group.hpp>
#include <cohort/parallel/canonical_order.hpp>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "support.hpp"

using namespace std::chrono_literals;
using cohort::op;
using group = cohort::process_group<cohort::gloo>;

namespace {

// Small integers keep every dtype exact (uint8 products included: at most 3^4 = 81).
int contribution(int rank, std::size_t index) { return static_cast<int>((rank + index) % 3) + 1; }

template <class T>
T make(double value) {
  if constexpr (std::is_same_v<T, cohort::half> || std::is_same_v<T, cohort::bfloat16>)
    return T(static_cast<float>(value));
  else
    return static_cast<T>(value);
}

template <class T>
double value_of(T value) {
  if constexpr (std::is_same_v<T, cohort::half> || std::is_same_v<T, cohort::bfloat16>)
    return static_cast<double>(static_cast<float>(value));
  else
    return static_cast<double>(value);
}

// The reduction of every rank's contribution at one index, computed directly.
template <class T>
double expected_reduction(op reduce, int world, std::size_t index) {
  double acc = contribution(0, index);
  for (int r = 1; r < world; ++r) {
    const double v = contribution(r, index);
    switch (reduce) {
      case op::sum:
      case op::avg: acc += v; break;
      case op::product: acc *= v; break;
      case op::min: acc = std::min(acc, v); break;
      case op::max: acc = std::max(acc, v); break;
    }
  }
  if (reduce == op::avg) {
    if constexpr (std::is_integral_v<T>)
      acc = std::trunc(acc / world);
    else
      acc /= world;
  }
  return acc;
}

template <class T>
bool close_enough(double got, double want, op reduce) {
  double tolerance = 0;
  if (reduce == op::avg && !std::is_integral_v<T>) tolerance = (sizeof(T) == 2 ? 1e-2 : 1e-6) * std::abs(want);
  return std::abs(got - want) <= tolerance;
}

std::shared_ptr<cohort::memory_store> fresh_store() { return std::make_shared<cohort::memory_store>(); }

group make_group(const std::shared_ptr<cohort::memory_store>& store, int rank, int world,
                 std::chrono::milliseconds timeout = 20s, bool debug = false) {
  cohort::gloo::options opts;
  opts.timeout = timeout;
  opts.debug_checks = debug;
  return group(store, cohort::launch_env::explicit_ranks(rank, world), opts);
}

const std::vector<std::size_t> sizes{0, 1, 7, 1000, 65537};

}  // namespace

TEMPLATE_TEST_CASE("all_reduce matches the directly computed reduction", "[process_group][gloo]", float, double,
                   cohort::half, cohort::bfloat16, std::int32_t, std::int64_t, std::uint8_t) {
  for (int world : {2, 3, 4}) {
    auto store = fresh_store();
    cohort_test::run_ranks(world, [&](int rank) {
      auto pg = make_group(store, rank, world);
      for (op reduce : {op::sum, op::avg, op::min, op::max, op::product}) {
        for (std::size_t n : sizes) {
          std::vector<TestType> in(n), out(n);
          for (std::size_t i = 0; i < n; ++i) in[i] = make<TestType>(contribution(rank, i));
          pg.all_reduce(std::span<const TestType>(in), std::span<TestType>(out), reduce).wait();
          // in place too
          pg.all_reduce(std::span<TestType>(in), reduce).wait();
          for (std::size_t i = 0; i < n; ++i) {
            const double want = expected_reduction<TestType>(reduce, world, i);
            RANK_CHECK(close_enough<TestType>(value_of(out[i]), want, reduce) &&
                           close_enough<TestType>(value_of(in[i]), want, reduce),
                       "world " << world << " op " << cohort::to_string(reduce) << " n " << n << " i " << i << ": got "
                                << value_of(out[i]) << " / " << value_of(in[i]) << ", want " << want);
          }
        }
      }
    });
  }
}

TEMPLATE_TEST_CASE("reduce_scatter leaves each rank its reduced chunk", "[process_group][gloo]", float, double,
                   cohort::half, cohort::bfloat16, std::int32_t, std::int64_t, std::uint8_t) {
  for (int world : {2, 3, 4}) {
    auto store = fresh_store();
    cohort_test::run_ranks(world, [&](int rank) {
      auto pg = make_group(store, rank, world);
      for (op reduce : {op::sum, op::avg, op::min, op::max, op::product}) {
        for (std::size_t chunk : {std::size_t{0}, std::size_t{1}, std::size_t{5}, std::size_t{4099}}) {
          const std::size_t n = chunk * static_cast<std::size_t>(world);
          std::vector<TestType> in(n), out(chunk);
          for (std::size_t i = 0; i < n; ++i) in[i] = make<TestType>(contribution(rank, i));
          pg.reduce_scatter(std::span<const TestType>(in), std::span<TestType>(out), reduce).wait();
          for (std::size_t i = 0; i < chunk; ++i) {
            const std::size_t global = static_cast<std::size_t>(rank) * chunk + i;
            const double want = expected_reduction<TestType>(reduce, world, global);
            RANK_CHECK(close_enough<TestType>(value_of(out[i]), want, reduce),
                       "world " << world << " op " << cohort::to_string(reduce) << " chunk " << chunk << " i " << i
                                << ": got " << value_of(out[i]) << ", want " << want);
          }
        }
      }
    });
  }
}

// Gloo averages floats by dividing each rank's part as it first reads it (no pass over the
// result), and a reduce-scatter divides in its last addition: the result must still be the
// sum divided by the world, at a size Gloo cuts into several segments per rank (5 MiB: over
// its 1 MiB segment per rank's chunk at 2, 3 and 4 ranks; larger only slows the sanitizer
// tiers) as well as at small ones, in place and out of place.
TEMPLATE_TEST_CASE("an average is the sum divided by the world, whatever the size", "[process_group][gloo]", float,
                   double, cohort::half, std::int32_t) {
  for (int world : {2, 3, 4}) {
    auto store = fresh_store();
    cohort_test::run_ranks(world, [&](int rank) {
      auto pg = make_group(store, rank, world);
      const auto w = static_cast<std::size_t>(world);
      for (const std::size_t n : {std::size_t{5}, std::size_t{1} << 12, (std::size_t{5} << 20) / sizeof(TestType)}) {
        // Values that are not multiples of the world, different on every rank.
        std::vector<TestType> in(n), averaged(n), in_place(n), summed(n);
        for (std::size_t i = 0; i < n; ++i) in[i] = make<TestType>(static_cast<double>((i * 7 + rank * 5) % 23) + 0.25);
        in_place = in;
        pg.all_reduce(std::span<const TestType>(in), std::span<TestType>(averaged), op::avg).wait();
        pg.all_reduce(std::span<TestType>(in_place), op::avg).wait();
        pg.all_reduce(std::span<const TestType>(in), std::span<TestType>(summed), op::sum).wait();
        const std::size_t chunk = n / w;
        std::vector<TestType> scattered(chunk);
        pg.reduce_scatter(std::span<const TestType>(in.data(), chunk * w), std::span<TestType>(scattered), op::avg)
            .wait();
        // Floats: within rounding of the sum's quotient (exact for a world that is a power of two,
        // where dividing first loses nothing); integers: the truncated quotient exactly.
        const auto close = [&](double got, double sum) {
          const double want = std::is_integral_v<TestType> ? std::trunc(sum / world) : sum / world;
          double tolerance = 0;
          if constexpr (!std::is_integral_v<TestType>)
            if ((world & (world - 1)) != 0 || sizeof(TestType) == 2)
              tolerance = (sizeof(TestType) == 2 ? 4e-3 : 1e-6) * std::abs(want);
          return std::abs(got - want) <= tolerance;
        };
        std::size_t wrong = 0;
        for (std::size_t i = 0; i < n; ++i)
          wrong +=
              !close(value_of(averaged[i]), value_of(summed[i])) || !close(value_of(in_place[i]), value_of(summed[i]));
        for (std::size_t i = 0; i < chunk; ++i)
          wrong += !close(value_of(scattered[i]), value_of(summed[static_cast<std::size_t>(rank) * chunk + i]));
        RANK_CHECK(wrong == 0, "world " << world << " n " << n << ": " << wrong << " elements off");
      }
    });
  }
}

TEMPLATE_TEST_CASE("all_gather, broadcast and all_to_all move every rank's data", "[process_group][gloo]", float,
                   double, cohort::half, cohort::bfloat16, std::int32_t, std::int64_t, std::uint8_t) {
  for (int world : {2, 3, 4}) {
    auto store = fresh_store();
    cohort_test::run_ranks(world, [&](int rank) {
      auto pg = make_group(store, rank, world);
      const auto w = static_cast<std::size_t>(world);
      for (std::size_t chunk : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{10007}}) {
        // all_gather, out of place and in place
        std::vector<TestType> mine(chunk), gathered(chunk * w), in_place(chunk * w);
        for (std::size_t i = 0; i < chunk; ++i) {
          mine[i] = make<TestType>(contribution(rank, i));
          in_place[static_cast<std::size_t>(rank) * chunk + i] = mine[i];
        }
        pg.all_gather(std::span<const TestType>(mine), std::span<TestType>(gathered)).wait();
        pg.all_gather(std::span<const TestType>(in_place.data() + static_cast<std::size_t>(rank) * chunk, chunk),
                      std::span<TestType>(in_place))
            .wait();
        for (int r = 0; r < world; ++r)
          for (std::size_t i = 0; i < chunk; ++i) {
            const double want = contribution(r, i);
            RANK_CHECK(value_of(gathered[static_cast<std::size_t>(r) * chunk + i]) == want);
            RANK_CHECK(value_of(in_place[static_cast<std::size_t>(r) * chunk + i]) == want);
          }
        // broadcast from every root
        for (int root = 0; root < world; ++root) {
          std::vector<TestType> data(chunk * 2 + 1);
          for (std::size_t i = 0; i < data.size(); ++i) data[i] = make<TestType>(contribution(rank, i));
          pg.broadcast(std::span<TestType>(data), root).wait();
          for (std::size_t i = 0; i < data.size(); ++i) RANK_CHECK(value_of(data[i]) == contribution(root, i));
        }
        // all_to_all: chunk r of my input goes to rank r; encode (sender, destination, i)
        std::vector<TestType> send(chunk * w), received(chunk * w);
        for (std::size_t r = 0; r < w; ++r)
          for (std::size_t i = 0; i < chunk; ++i)
            send[r * chunk + i] =
                make<TestType>(static_cast<double>((static_cast<std::size_t>(rank) * 7 + r * 3 + i) % 50));
        pg.all_to_all(std::span<const TestType>(send), std::span<TestType>(received)).wait();
        for (std::size_t from = 0; from < w; ++from)
          for (std::size_t i = 0; i < chunk; ++i)
            RANK_CHECK(value_of(received[from * chunk + i]) ==
                       static_cast<double>((from * 7 + static_cast<std::size_t>(rank) * 3 + i) % 50));
      }
    });
  }
}

TEST_CASE("send and recv pair up by peer and tag, and collectives complete in issue order", "[process_group][gloo]") {
  auto store = fresh_store();
  cohort_test::run_ranks(3, [&](int rank) {
    auto pg = make_group(store, rank, 3);
    const int next = (rank + 1) % 3, previous = (rank + 2) % 3;
    std::vector<std::int64_t> out(1000, rank), in(1000, -1), out2(3, rank * 100), in2(3, -1);
    auto s1 = pg.send(std::span<const std::int64_t>(out), next, 7);
    auto s2 = pg.send(std::span<const std::int64_t>(out2), next, 8);
    auto r2 = pg.recv(std::span<std::int64_t>(in2), previous, 8);
    auto r1 = pg.recv(std::span<std::int64_t>(in), previous, 7);
    // Many asynchronous collectives in flight at once, waited in reverse order.
    std::vector<std::vector<float>> buffers(20, std::vector<float>(100, 1.0f));
    std::vector<group::work> works;
    for (auto& buffer : buffers) works.push_back(pg.all_reduce(std::span<float>(buffer)));
    for (auto it = works.rbegin(); it != works.rend(); ++it) it->wait();
    for (auto& buffer : buffers) RANK_CHECK(buffer[99] == 3.0f);
    for (auto* w : {&s1, &s2, &r1, &r2}) w->wait();
    RANK_CHECK(in == std::vector<std::int64_t>(1000, previous));
    RANK_CHECK(in2 == std::vector<std::int64_t>(3, previous * 100));
    RANK_CHECK(works.front().test());
  });
}

TEST_CASE("split and node_local form the right subgroups", "[process_group][gloo]") {
  auto store = fresh_store();
  cohort_test::run_ranks(4, [&](int rank) {
    // Two simulated nodes of two ranks each.
    cohort::gloo::options opts;
    opts.timeout = 20s;
    group pg(store, cohort::launch_env::explicit_values(rank, 4, rank % 2, 2), opts);
    auto evens = pg.split(rank % 2 == 0 ? 0 : -1, -rank);  // odd ranks join none; reversed order
    if (rank % 2 == 0) {
      RANK_CHECK(evens.has_value());
      RANK_CHECK(evens->size() == 2);
      RANK_CHECK(evens->rank() == (rank == 2 ? 0 : 1));
      std::vector<int> value{rank};
      evens->all_reduce(std::span<int>(value)).wait();
      RANK_CHECK(value[0] == 2);
    } else {
      RANK_CHECK(!evens.has_value());
    }
    auto node = pg.node_local();
    RANK_CHECK(node.size() == 2);
    RANK_CHECK(node.rank() == rank % 2);
    std::vector<int> sum{rank};
    node.all_reduce(std::span<int>(sum)).wait();
    RANK_CHECK(sum[0] == (rank < 2 ? 1 : 5));
  });
}

TEST_CASE("a rank that never arrives is a timeout error on the others, not a hang", "[process_group][gloo][faults]") {
  auto store = fresh_store();
  const auto started = std::chrono::steady_clock::now();
  // World of 3; rank 2 never starts.
  std::vector<std::string> messages(2);
  cohort_test::run_ranks(2, [&](int rank) {
    try {
      auto pg = make_group(store, rank, 3, 2s);
      throw cohort_test::rank_failure("the group formed without rank 2");
    } catch (const cohort::timeout_error& failure) {
      messages[static_cast<std::size_t>(rank)] = failure.what();
    }
  });
  const auto elapsed = std::chrono::steady_clock::now() - started;
  RANK_CHECK(elapsed < 15s);
  for (const auto& text : messages) {
    INFO(text);
    REQUIRE_THAT(text, Catch::Contains("rank 2 never arrived at the rendezvous"));
  }
}

// A rank that is not inside a cohort call cannot say what it does: it is named as unknown
// (it may be computing, stopped or stuck), never accused of not issuing a call it may be
// about to issue.
TEST_CASE("a rank that never issues a collective is named in every other rank's error",
          "[process_group][gloo][faults]") {
  auto store = fresh_store();
  std::vector<std::string> messages(3);
  std::atomic<int> named{0};
  const auto started = std::chrono::steady_clock::now();
  cohort_test::run_ranks(3, [&](int rank) {
    auto pg = make_group(store, rank, 3, 2s);
    std::vector<float> data(1000, 1.0f);
    pg.all_reduce(std::span<float>(data)).wait();
    if (rank == 2) {
      // Busy elsewhere (a longer backward, a data-loader stall) past the others' timeout
      // and their report window, until both have their errors, then gone without issuing
      // the second call.
      cohort_test::wait_for_count(named, 2, 12s);
      return;
    }
    try {
      pg.all_reduce(std::span<float>(data)).wait();
      throw cohort_test::rank_failure("the second all_reduce completed without rank 2");
    } catch (const cohort::timeout_error& failure) {
      messages[static_cast<std::size_t>(rank)] = failure.what();
      ++named;
    }
  });
  RANK_CHECK(std::chrono::steady_clock::now() - started < 15s);
  for (int rank = 0; rank < 2; ++rank) {
    const auto& text = messages[static_cast<std::size_t>(rank)];
    INFO("rank " << rank << ": " << text);
    REQUIRE_THAT(text, Catch::Contains("rank 2 is unknown (no report within 2 s") &&
                           // "waiting in", or "in" for the rank that failed when the other closed
                           Catch::Contains("ranks 0, 1 are ") && Catch::Contains(" in all_reduce #2") &&
                           !Catch::Contains("never issued"));
  }
}

TEST_CASE("monitored_barrier names every rank that did not arrive, on every rank that did",
          "[process_group][gloo][faults]") {
  auto store = fresh_store();
  std::vector<std::string> messages(4);
  cohort_test::run_ranks(4, [&](int rank) {
    auto pg = make_group(store, rank, 4, 20s);
    // Late but within the timeout: not reported.
    if (rank == 1) std::this_thread::sleep_for(300ms);
    pg.monitored_barrier(5s);
    if (rank == 2 || rank == 3) return;  // never arrive at the second barrier
    try {
      pg.monitored_barrier(1s);
      throw cohort_test::rank_failure("the monitored barrier passed without ranks 2 and 3");
    } catch (const cohort::timeout_error& failure) {
      messages[static_cast<std::size_t>(rank)] = failure.what();
    }
  });
  for (int rank = 0; rank < 2; ++rank) {
    INFO(messages[static_cast<std::size_t>(rank)]);
    REQUIRE_THAT(messages[static_cast<std::size_t>(rank)],
                 Catch::Contains("monitored_barrier #2") && Catch::Contains("ranks 2, 3 did not arrive within 1 s"));
  }
}

// In a subgroup (world ranks 1, 3 of 4) world rank 3 skips the second monitored barrier. World
// rank 1, the group's rank 0, said "cohort [rank 0] ...: rank 1 did not arrive": its own world
// number, in the group's numbering. Now it names the group and world rank 3; and the group of
// world ranks 0, 2, where all arrive, passes.
TEST_CASE("monitored_barrier in a subgroup names the group and the missing rank's world rank",
          "[process_group][gloo][faults]") {
  auto store = fresh_store();
  std::vector<std::string> messages(4);
  cohort_test::run_ranks(4, [&](int rank) {
    auto pg = make_group(store, rank, 4, 20s);
    auto pair = pg.split(rank % 2, rank);
    pair->monitored_barrier(5s);
    if (rank == 3) return;
    try {
      pair->monitored_barrier(1s);
    } catch (const cohort::timeout_error& failure) {
      messages[static_cast<std::size_t>(rank)] = failure.what();
    }
  });
  for (const int rank : {0, 2}) CHECK(messages[static_cast<std::size_t>(rank)].empty());
  INFO(messages[1]);
  CHECK_THAT(messages[1],
             Catch::StartsWith("cohort [rank 1] gloo.monitored_barrier #2: group ") &&
                 Catch::Contains("(world ranks 1, 3): world rank 3 (group rank 1) did not arrive within 1 s"));
}

TEST_CASE("a rank that skips a call is never paired with the next one: each error names the other's call",
          "[process_group][gloo][faults]") {
  // Rank 1 skips the broadcast. Its all_reduce is its second call, the broadcast is rank 0's
  // second: the sequence number keeps them apart, so neither completes with the other's data.
  auto store = fresh_store();
  std::vector<std::string> messages(2);
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = make_group(store, rank, 2, 2s);
    std::vector<float> data(256, 1.0f);
    pg.all_reduce(std::span<float>(data)).wait();
    try {
      if (rank == 0) pg.broadcast(std::span<float>(data), 0).wait();
      pg.all_reduce(std::span<float>(data)).wait();
      throw cohort_test::rank_failure("a call completed although the ranks issued different calls");
    } catch (const cohort::error& failure) {
      messages[static_cast<std::size_t>(rank)] = failure.what();
    }
  });
  INFO(messages[0]);
  INFO(messages[1]);
  REQUIRE_THAT(messages[0], Catch::Contains("rank 1 is in all_reduce #2 (float x 256, sum)"));
  REQUIRE_THAT(messages[1], Catch::Contains("rank 0 is in broadcast #2 (float x 256, root 0)"));
}

TEST_CASE("a peer that stops participating turns a collective into an error within the timeout",
          "[process_group][gloo][faults]") {
  auto store = fresh_store();
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = make_group(store, rank, 2, 2s);
    std::vector<float> data(1000, 1.0f);
    pg.all_reduce(std::span<float>(data)).wait();
    if (rank == 1) return;  // rank 1 leaves: its group (and sockets) is destroyed here
    const auto started = std::chrono::steady_clock::now();
    RANK_CHECK_THROWS(cohort::error, pg.all_reduce(std::span<float>(data)).wait(), "all_reduce");
    RANK_CHECK(std::chrono::steady_clock::now() - started < 10s);
    // The group is unusable afterwards and says so rather than hanging.
    RANK_CHECK_THROWS(cohort::error, pg.barrier().wait(), "rank 0");
  });
}

TEST_CASE("mismatched sizes across ranks: a clear error with debug checks, never silent",
          "[process_group][gloo][faults]") {
  SECTION("debug checks name both calls") {
    auto store = fresh_store();
    std::vector<std::string> messages(2);
    cohort_test::run_ranks(2, [&](int rank) {
      auto pg = make_group(store, rank, 2, 2s, /*debug=*/true);
      std::vector<float> data(rank == 0 ? 100 : 99, 1.0f);
      try {
        pg.all_reduce(std::span<float>(data)).wait();
      } catch (const cohort::error& failure) {
        messages[static_cast<std::size_t>(rank)] = failure.what();
      }
    });
    for (const auto& text : messages) {
      INFO(text);
      REQUIRE_THAT(text, Catch::Contains("float x 100") && Catch::Contains("float x 99"));
    }
  }
  SECTION("without debug checks the engine still fails within the timeout") {
    auto store = fresh_store();
    int failures = 0;
    std::mutex mutex;
    cohort_test::run_ranks(2, [&](int rank) {
      auto pg = make_group(store, rank, 2, 2s);
      std::vector<float> data(rank == 0 ? 4096 : 1024, 1.0f);
      try {
        pg.all_reduce(std::span<float>(data)).wait();
      } catch (const cohort::error&) {
        std::lock_guard lock(mutex);
        ++failures;
      }
    });
    RANK_CHECK(failures >= 1);
  }
}

// Without debug checks a point-to-point call still knows its peer and its size: a mismatch
// names both on each side (the size, and the peer's call where its status says it).
TEST_CASE("a send/recv size or peer mismatch names the peer and the bytes without debug checks",
          "[process_group][gloo][faults]") {
  SECTION("sizes differ") {
    auto store = fresh_store();
    std::vector<std::string> messages(2);
    cohort_test::run_ranks(2, [&](int rank) {
      auto pg = make_group(store, rank, 2, 2s);
      std::vector<float> data(rank == 0 ? 100 : 50, 1.0f);
      try {
        if (rank == 0)
          pg.send(std::span<float>(data), 1, 3).wait();
        else
          pg.recv(std::span<float>(data), 0, 3).wait();
        pg.barrier().wait();  // the sender learns of the failure here at the latest
      } catch (const cohort::error& failure) {
        messages[static_cast<std::size_t>(rank)] = failure.what();
      }
    });
    INFO(messages[0]);
    INFO(messages[1]);
    CHECK_THAT(messages[1], Catch::Contains("this rank is in recv #1 from rank 0 of 200 bytes (float x 50, tag 3); "
                                            "rank 0 failed in send #1 to rank 1 of 400 bytes (float x 100, tag 3): "
                                            "the sizes differ"));
    CHECK_THAT(messages[0], Catch::Contains("this rank is in send #1 to rank 1 of 400 bytes (float x 100, tag 3); "
                                            "rank 1 failed in recv #1 from rank 0 of 200 bytes (float x 50, tag 3): "
                                            "the sizes differ"));
  }
  SECTION("peers differ") {
    auto store = fresh_store();
    std::vector<std::string> messages(3);
    cohort_test::run_ranks(3, [&](int rank) {
      auto pg = make_group(store, rank, 3, 2s);
      std::vector<float> data(16, 1.0f);
      try {
        if (rank == 0) pg.send(std::span<float>(data), 2, 3).wait();  // rank 1 waits for it
        if (rank == 1) pg.recv(std::span<float>(data), 0, 3).wait();
        if (rank == 2) pg.recv(std::span<float>(data), 1, 3).wait();  // rank 1 never sends
      } catch (const cohort::error& failure) {
        messages[static_cast<std::size_t>(rank)] = failure.what();
      }
    });
    for (const auto& text : messages) UNSCOPED_INFO(text);
    CHECK_THAT(messages[1], Catch::Contains("this rank is in recv #1 from rank 0 of 64 bytes") &&
                                Catch::Contains("rank 0 failed in send #1 to rank 2 of 64 bytes (float x 16, tag 3), "
                                                "not the send that pairs with this recv"));
    CHECK_THAT(messages[2], Catch::Contains("this rank is in recv #1 from rank 1 of 64 bytes") &&
                                Catch::Contains("rank 1 failed in recv #1 from rank 0 of 64 bytes"));
    CHECK_THAT(messages[0], Catch::Contains("this rank is in send #1 to rank 2 of 64 bytes") &&
                                Catch::Contains("rank 2 failed in recv #1 from rank 1 of 64 bytes"));
  }
}

TEST_CASE("local checks reject impossible calls with the sizes in the message", "[process_group][gloo]") {
  auto store = fresh_store();
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = make_group(store, rank, 2);
    std::vector<float> in(10), out(4);
    RANK_CHECK_THROWS(cohort::error, pg.reduce_scatter(std::span<const float>(in), std::span<float>(out)),
                      "10 elements, expected output size 4 x world 2");
    RANK_CHECK_THROWS(cohort::error, pg.broadcast(std::span<float>(out), 2), "root 2");
    RANK_CHECK_THROWS(cohort::error, pg.all_reduce(std::span<const float>(in), std::span<float>(out)), "output has 4");
    pg.barrier().wait();
  });
}

TEST_CASE("a collective inside a main-only section is refused instead of deadlocking",
          "[process_group][gloo][faults]") {
  auto store = fresh_store();
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = make_group(store, rank, 2);
    if (rank == 0) {
      auto section = pg.main_only_section();
      std::vector<float> data(4);
      RANK_CHECK_THROWS(cohort::error, pg.all_reduce(std::span<float>(data)), "on_main");
    }
    pg.barrier().wait();  // outside the section everything works again
  });
}

TEST_CASE("an unmatched recv does not hold up the group's destruction", "[process_group][gloo][faults]") {
  auto store = fresh_store();
  double seconds = 0;
  cohort_test::run_ranks(2, [&](int rank) {
    std::vector<float> never(16);
    auto pg = std::make_unique<group>(make_group(store, rank, 2, 30s));
    if (rank == 0) pg->recv(std::span<float>(never), 1, 99);  // rank 1 never sends this
    pg->barrier().wait();
    if (rank == 1) {
      // Stay connected until rank 0 is gone, so nothing but the abort can end its wait.
      store->get("rank 0 destroyed its group");
      return;
    }
    const auto started = std::chrono::steady_clock::now();
    pg.reset();
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    store->set("rank 0 destroyed its group", "yes");
  });
  INFO("destruction took " << seconds << " s; the group's timeout is 30 s");
  REQUIRE(seconds < 5.0);
}

TEST_CASE("empty copies are no-ops whatever their pointers (null included)", "[process_group][gloo]") {
  auto store = fresh_store();
  cohort_test::run_ranks(1, [&](int rank) {
    auto pg = make_group(store, rank, 1);
    auto& engine = pg.backend();
    engine.copy(nullptr, nullptr, 0).wait();
    float a = 1.0f, b = 2.0f;
    const std::vector<cohort::copy_region> regions{{nullptr, nullptr, 0}, {&a, &b, sizeof a}, {&b, nullptr, 0}};
    cohort::batched_copy(engine, std::span<const cohort::copy_region>(regions)).wait();
    RANK_CHECK(a == 2.0f && b == 2.0f);
  });
}

TEST_CASE("building process groups leaves the caller's store settings alone", "[process_group][gloo][store]") {
  auto store = fresh_store();
  store->set_timeout(5s);
  store->set_rank(-1);
  cohort_test::run_ranks(3, [&](int rank) {
    // Each group waits on the shared store with its own timeout; none may change the store's.
    auto pg = make_group(store, rank, 3, std::chrono::milliseconds(1500 + 500 * rank));
    pg.barrier().wait();
    auto sub = pg.split(rank == 2 ? 1 : 0, rank);
    RANK_CHECK(sub.has_value());
    sub->barrier().wait();
  });
  CHECK(store->timeout() == 5s);
  CHECK(store->rank() == -1);
}

// ---- collectives on any contiguous range ------------------------------------------------------

namespace {
template <class G, class... Args>
concept all_reduce_takes = requires(G& pg, Args&&... args) {
  pg.all_reduce(std::forward<Args>(args)...);
};
template <class G, class... Args>
concept broadcast_takes = requires(G& pg, Args&&... args) {
  pg.broadcast(std::forward<Args>(args)...);
};
template <class G, class... Args>
concept send_takes = requires(G& pg, Args&&... args) {
  pg.send(std::forward<Args>(args)...);
};
}  // namespace

// Ranges as lvalues, spans as before; a temporary container (the work would outlive it), a
// read-only output or mismatched element types do not compile.
static_assert(all_reduce_takes<group, std::vector<float>&>);
static_assert(all_reduce_takes<group, std::vector<float>&, op>);
static_assert(all_reduce_takes<group, std::array<double, 3>&>);
static_assert(all_reduce_takes<group, std::int32_t (&)[4], op>);
static_assert(all_reduce_takes<group, std::span<float, 4>>);
static_assert(all_reduce_takes<group, std::span<float>>);
static_assert(all_reduce_takes<group, const std::vector<float>&, std::vector<float>&, op>);
static_assert(all_reduce_takes<group, std::span<const float>, std::vector<float>&>);
static_assert(all_reduce_takes<group, std::vector<float>&, std::span<float>>);
static_assert(!all_reduce_takes<group, std::vector<float>>);
static_assert(!all_reduce_takes<group, const std::vector<float>&>);
static_assert(!all_reduce_takes<group, std::vector<float>&, std::vector<float>>);
static_assert(!all_reduce_takes<group, std::vector<double>&, std::vector<float>&>);
static_assert(!all_reduce_takes<group, std::vector<long long>&>);  // not a cohort element type
static_assert(broadcast_takes<group, std::vector<cohort::half>&, int>);
static_assert(send_takes<group, const std::vector<float>&, int>);
static_assert(!send_takes<group, std::vector<float>, int>);

TEST_CASE("collectives take vectors, std::arrays and C arrays as they take spans", "[process_group][gloo]") {
  constexpr int world = 3;
  auto store = fresh_store();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world);
    const auto w = static_cast<std::size_t>(world);
    std::vector<float> values(5);
    for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(contribution(rank, i));
    pg.all_reduce(values).wait();
    for (std::size_t i = 0; i < values.size(); ++i)
      RANK_CHECK(values[i] == expected_reduction<float>(op::sum, world, i), "i " << i << " got " << values[i]);

    const std::vector<std::int32_t> in{rank, 10 - rank, 7};
    std::array<std::int32_t, 3> out{};
    pg.all_reduce(in, out, op::max).wait();
    RANK_CHECK(out[0] == world - 1 && out[1] == 10 && out[2] == 7);

    double c_array[4] = {0, 0, 0, 0};
    for (auto& x : c_array) x = rank;
    pg.all_reduce(c_array, op::avg).wait();
    for (auto x : c_array) RANK_CHECK(x == 1.0, "got " << x);  // (0 + 1 + 2) / 3

    std::array<std::uint8_t, 3> bytes{};
    bytes.fill(static_cast<std::uint8_t>(rank + 1));
    pg.broadcast(bytes, 1).wait();
    for (auto b : bytes) RANK_CHECK(b == 2);

    const std::vector<float> mine{static_cast<float>(rank), static_cast<float>(10 * rank)};
    std::vector<float> gathered(2 * w);
    pg.all_gather(mine, gathered).wait();
    for (std::size_t r = 0; r < w; ++r)
      RANK_CHECK(gathered[2 * r] == static_cast<float>(r) && gathered[2 * r + 1] == static_cast<float>(10 * r));

    std::vector<std::int64_t> scatter_in(2 * w);
    for (std::size_t i = 0; i < scatter_in.size(); ++i) scatter_in[i] = static_cast<std::int64_t>(i) + rank;
    std::array<std::int64_t, 2> shard{};
    pg.reduce_scatter(scatter_in, shard).wait();
    for (std::size_t i = 0; i < 2; ++i)  // the sum over ranks q of (2 * rank + i + q)
      RANK_CHECK(shard[i] ==
                 static_cast<std::int64_t>(world * (2 * rank + static_cast<int>(i)) + world * (world - 1) / 2));

    std::vector<double> to(w), from(w);
    for (std::size_t r = 0; r < w; ++r) to[r] = 100.0 * rank + static_cast<double>(r);
    pg.all_to_all(to, from).wait();
    for (std::size_t r = 0; r < w; ++r) RANK_CHECK(from[r] == 100.0 * static_cast<double>(r) + rank);

    // A fixed-extent span, and point-to-point around the ring.
    pg.all_reduce(std::span<float, 5>(values.data(), 5), op::min).wait();
    const std::vector<std::int64_t> message{rank, 10 * rank};
    std::array<std::int64_t, 2> received{};
    auto sent = pg.send(message, (rank + 1) % world, 5);
    pg.recv(received, (rank + world - 1) % world, 5).wait();
    sent.wait();
    const int left = (rank + world - 1) % world;
    RANK_CHECK(received[0] == left && received[1] == 10 * left);

    // The span overloads' checks, through a range.
    std::vector<float> wrong(4), ten(10);
    RANK_CHECK_THROWS(cohort::error, pg.all_reduce(ten, wrong), "output has 4");
  });
}

// ---- stream-ordered collectives ----------------------------------------------------------------

static_assert(std::is_same_v<group::stream_type, std::nullptr_t>);

TEST_CASE("stream-ordered collectives on Gloo return complete: the caller's order is its thread",
          "[process_group][gloo]") {
  constexpr int world = 2;
  auto store = fresh_store();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world);
    std::vector<float> values(1000, static_cast<float>(rank + 1));
    auto on_mine = pg.on(nullptr);
    auto done = on_mine.all_reduce(values, op::avg);
    RANK_CHECK(done.test(), "the caller's order waits for the result: done on return");
    for (auto x : values) RANK_CHECK(x == 1.5f, "got " << x);
    std::vector<float> gathered(2000);
    RANK_CHECK(on_mine.all_gather(std::span<const float>(values), std::span<float>(gathered)).test());
    std::vector<std::int32_t> root(3, rank);
    RANK_CHECK(pg.on(pg.backend().stream()).broadcast(std::span<std::int32_t>(root), 1).test());
    RANK_CHECK(root == std::vector<std::int32_t>(3, 1));
    RANK_CHECK(on_mine.barrier().test());
    std::array<float, 2> one{}, other{};
    one.fill(static_cast<float>(rank));
    // Each call returns complete, as blocking calls do: one side sends first, the other receives.
    if (rank == 0) {
      RANK_CHECK(on_mine.send(one, 1, 9).test());
      RANK_CHECK(on_mine.recv(other, 1, 9).test());
    } else {
      RANK_CHECK(on_mine.recv(other, 0, 9).test());
      RANK_CHECK(on_mine.send(one, 0, 9).test());
    }
    RANK_CHECK(other[0] == static_cast<float>(1 - rank));
    // What the plain overloads refuse, the view refuses too.
    std::vector<float> wrong(3);
    RANK_CHECK_THROWS(cohort::error, on_mine.all_reduce(std::span<const float>(values), std::span<float>(wrong)),
                      "output has 3");
  });
}

// ---- one host value across ranks -----------------------------------------------------------------

TEST_CASE("all_reduce_value gives every rank the same mean, sum, min and max of values that differ",
          "[process_group][gloo]") {
  for (int world : {2, 3, 4}) {
    auto store = fresh_store();
    cohort_test::run_ranks(world, [&](int rank) {
      auto pg = make_group(store, rank, world);
      const float loss = 0.5f * static_cast<float>(rank + 1);  // 0.5, 1.0, 1.5, ...
      const float mean_loss = cohort::all_reduce_value(pg, loss, op::avg);
      RANK_CHECK(std::abs(mean_loss - 0.25f * static_cast<float>(world + 1)) < 1e-6f, "got " << mean_loss);
      RANK_CHECK(cohort::all_reduce_value(pg, rank + 1) == world * (world + 1) / 2);  // int
      const std::size_t tokens = 1000 * static_cast<std::size_t>(rank);               // not an element: int64
      RANK_CHECK(cohort::all_reduce_value(pg, tokens, op::max) == 1000 * static_cast<std::size_t>(world - 1));
      RANK_CHECK(cohort::all_reduce_value(pg, -1.0 * rank, op::min) == -1.0 * (world - 1));
      RANK_CHECK(cohort::all_reduce_value(pg, std::uint64_t{1} << 40) == std::uint64_t(world) << 40);
      const auto biggest = cohort::all_reduce_value(pg, cohort::half(static_cast<float>(rank)), op::max);
      RANK_CHECK(static_cast<float>(biggest) == static_cast<float>(world - 1));
      RANK_CHECK(cohort::all_reduce_value(pg, 2.0L, op::product) == std::pow(2.0L, world));  // long double

      // A few values in one call: a braced list, or any contiguous range.
      const auto sums = cohort::all_reduce_values(pg, {loss, 1.0f});
      RANK_CHECK(sums.size() == 2 && sums[1] == static_cast<float>(world));
      const std::vector<std::int64_t> counts{rank, 1, -rank};
      const std::vector<std::int64_t> extremes = cohort::all_reduce_values(pg, counts, op::max);
      RANK_CHECK(extremes == (std::vector<std::int64_t>{world - 1, 1, 0}));
    });
  }
}

TEST_CASE("canonical_mean gives the same bits at 1, 2, 4 and 8 ranks for the same sequence of values",
          "[process_group][gloo]") {
  // Eight losses of very different sizes, so that the order of addition shows in the bits.
  const std::vector<float> losses{1e-3f, 3.7f, 2.5e-7f, 0.125f, 9.1e4f, 1.3f, 7e-5f, 0.33f};
  const float expected = cohort::canonical_sum(std::span<const float>(losses)) / 8.0f;
  for (int world : {1, 2, 4, 8}) {
    auto store = fresh_store();
    std::vector<float> means(static_cast<std::size_t>(world));
    std::vector<double> double_means(static_cast<std::size_t>(world));
    cohort_test::run_ranks(world, [&](int rank) {
      auto pg = make_group(store, rank, world);
      const std::size_t run = losses.size() / static_cast<std::size_t>(world);
      const std::span<const float> mine(losses.data() + static_cast<std::size_t>(rank) * run, run);
      means[static_cast<std::size_t>(rank)] = cohort::canonical_mean(pg, mine);
      const std::vector<double> wide(mine.begin(), mine.end());
      double_means[static_cast<std::size_t>(rank)] = cohort::canonical_mean(pg, std::span<const double>(wide));
    });
    for (int rank = 0; rank < world; ++rank) {
      INFO("world " << world << " rank " << rank);
      CHECK(std::memcmp(&means[static_cast<std::size_t>(rank)], &expected, sizeof expected) == 0);
      CHECK(double_means[static_cast<std::size_t>(rank)] == double_means[0]);
    }
  }
}

TEST_CASE("canonical_sum adds in for_each_canonical_pair's tree for every count", "[process_group]") {
  for (std::size_t n = 1; n <= 70; ++n) {
    std::vector<float> values(n);
    for (std::size_t i = 0; i < n; ++i)  // magnitudes from 1e-6 to 1e6, so the order shows in the bits
      values[i] = std::ldexp(1.0f + 0.37f * static_cast<float>(i % 5), static_cast<int>((i * 7) % 41) - 20);
    std::vector<float> tree = values;
    cohort::for_each_canonical_pair(n, [&](std::size_t into, std::size_t from) { tree[into] += tree[from]; });
    const float sum = cohort::canonical_sum(std::span<const float>(values));
    INFO("n " << n);
    CHECK(std::memcmp(&sum, &tree[0], sizeof sum) == 0);
  }
}

TEST_CASE("canonical_mean: a rank that passes another count of values fails on every rank, named",
          "[process_group][gloo][faults]") {
  auto store = fresh_store();
  const auto started = std::chrono::steady_clock::now();
  cohort_test::run_ranks(3, [&](int rank) {
    auto pg = make_group(store, rank, 3);
    const std::vector<double> losses(rank == 1 ? 3 : 2, 0.5);
    RANK_CHECK_THROWS(cohort::error, cohort::canonical_mean(pg, std::span<const double>(losses)),
                      "different counts of values (rank 0: 2, rank 1: 3, rank 2: 2)");
    RANK_CHECK(cohort::all_reduce_value(pg, 1) == 3);  // the group still works: nobody left waiting
  });
  CHECK(std::chrono::steady_clock::now() - started < 10s);
}

TEST_CASE("all_reduce_value is a collective: refused inside a main-only section", "[process_group][gloo][faults]") {
  auto store = fresh_store();
  cohort_test::run_ranks(2, [&](int rank) {
    auto pg = make_group(store, rank, 2);
    if (rank == 0) {
      auto section = pg.main_only_section();
      RANK_CHECK_THROWS(cohort::error, cohort::all_reduce_value(pg, 1.0f), "on_main");
    }
    RANK_CHECK(cohort::all_reduce_value(pg, 1.0f) == 2.0f);
  });
}
