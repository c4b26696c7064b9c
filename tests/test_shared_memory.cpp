// The Gloo backend's intra-host transport (cohort/comm/detail/shared_memory_channel.hpp):
// ranks of one host meet in shared memory for all-reduce, reduce-scatter and all-gather. The
// results must equal a reference computed here, at sizes that cross the slot's chunks and
// leave some ranks' parts empty, in place and out; a group where one rank opts out stays on
// TCP on every rank; a forged segment record is refused before anything opens its file for
// writing; ranks in different calls never read each other's data, and fail as they do over
// TCP; a peer process that ended is noticed though nobody reaped it; 16-bit float sums give
// the bits TCP gives; and a rank whose buffers overlap oddly stays on the group's transport. (test_process_group runs
// every collective over both transports: once as it is, once as test_process_group_tcp.)
#include <fcntl.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <cohort/comm/detail/shared_memory_channel.hpp>
#include <cohort/comm/gloo.hpp>
#include <cohort/comm/ops.hpp>
#include <cohort/comm/process_group.hpp>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
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

        // all_to_all: part r of this rank's input to rank r, out of place and in place (the
        // input staged first), across the slot's rounds.
        std::vector<float> received(n * w, -1.0f), exchanged_in_place = blocks;
        pg.all_to_all(std::span<const float>(blocks), std::span<float>(received)).wait();
        pg.all_to_all(std::span<const float>(exchanged_in_place), std::span<float>(exchanged_in_place)).wait();
        for (std::size_t q = 0; q < w; ++q)
          for (std::size_t i = 0; i < n; ++i) {
            const float want = contribution(static_cast<int>(q), own + i);
            wrong += received[q * n + i] != want || exchanged_in_place[q * n + i] != want;
          }
        RANK_CHECK(wrong == 0, "all_to_all, world " << world << ", n " << n << ": " << wrong << " elements off");
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

namespace {

// A segment record with its process and descriptor fields replaced (the rest as published).
std::string record_leading_to(const std::string& published, long pid, int fd) {
  std::istringstream fields(published);
  std::string format, old_pid, old_fd, rest;
  fields >> format >> old_pid >> old_fd;
  std::getline(fields, rest);
  return format + " " + std::to_string(pid) + " " + std::to_string(fd) + rest;
}

}  // namespace

// A record whose process and descriptor lead to a file that is not a segment (a rank in
// another pid namespace, a forged record): refused, and the file never opened for writing
// (inotify tells a descriptor closed after writing from one closed after reading).
TEST_CASE("a record that leads to another file is refused before it is opened for writing", "[shared_memory]") {
  using cohort::detail::shared_memory_channel;
  auto first = shared_memory_channel::create(0, 2);
  auto second = shared_memory_channel::create(1, 2);
  REQUIRE(first);
  REQUIRE(second);
  // A file of a segment's own size (the size check alone does not refuse it), other bytes.
  const std::string published = second->published();
  std::istringstream fields(published);
  std::string format;
  long pid = 0;
  int segment_fd = -1;
  fields >> format >> pid >> segment_fd;
  struct stat segment {};
  REQUIRE(::fstat(segment_fd, &segment) == 0);
  char name[] = "/tmp/cohort-forged-XXXXXX";
  const int victim = ::mkstemp(name);
  REQUIRE(victim >= 0);
  ::unlink(name);
  REQUIRE(::ftruncate(victim, segment.st_size) == 0);
  const std::string bytes(4096, 'x');
  REQUIRE(::pwrite(victim, bytes.data(), bytes.size(), 0) == static_cast<ssize_t>(bytes.size()));
  const int watch = ::inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  REQUIRE(watch >= 0);
  REQUIRE(::inotify_add_watch(watch, ("/proc/self/fd/" + std::to_string(victim)).c_str(), IN_CLOSE_WRITE | IN_MODIFY) >=
          0);

  const std::vector<shared_memory_channel::peer_process> processes(2);
  CHECK_FALSE(first->map_peers({first->published(), record_leading_to(published, ::getpid(), victim)}, processes));
  // The true record still maps; and once the channel is gone, so is every mapping it made
  // (a file's last close, the one inotify reports, comes with its last mapping's end).
  CHECK(first->map_peers({first->published(), published}, processes));
  first.reset();

  alignas(inotify_event) char events[4096];
  const ssize_t got = ::read(watch, events, sizeof events);
  CHECK(got < 0);  // no event: nothing opened the file for writing, nor wrote it
  std::string content(bytes.size(), '\0');
  REQUIRE(::pread(victim, content.data(), content.size(), 0) == static_cast<ssize_t>(content.size()));
  CHECK(content == bytes);
  ::close(watch);
  ::close(victim);
}

// Rank 1 is a child process that maps the segments and ends without a word (no close, as a
// crash); this process, its launcher, reaps it only after its own call ends, as a launcher
// that waits for its children in order does: a zombie the process table still lists.
TEST_CASE("a peer process that ended is noticed at once though nobody reaped it", "[shared_memory][faults]") {
  using cohort::detail::shared_memory_channel;
  auto mine = shared_memory_channel::create(0, 2);
  REQUIRE(mine);
  int to_child[2], to_parent[2];
  REQUIRE(::pipe(to_child) == 0);
  REQUIRE(::pipe(to_parent) == 0);
  const auto send = [](int fd, const std::string& text) {
    const std::uint32_t n = static_cast<std::uint32_t>(text.size());
    return ::write(fd, &n, sizeof n) == sizeof n && ::write(fd, text.data(), n) == static_cast<ssize_t>(n);
  };
  const auto receive = [](int fd) {
    std::uint32_t n = 0;
    if (::read(fd, &n, sizeof n) != sizeof n) return std::string();
    std::string text(n, '\0');
    return ::read(fd, text.data(), n) == static_cast<ssize_t>(n) ? text : std::string();
  };
  const long parent = ::getpid();
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    auto theirs = shared_memory_channel::create(1, 2);
    if (!theirs || !send(to_parent[1], theirs->published())) ::_exit(2);
    const std::string rank0 = receive(to_child[0]);
    const bool mapped = theirs->map_peers({rank0, theirs->published()}, {{parent}, {::getpid()}});
    send(to_parent[1], mapped ? "mapped" : "failed");
    ::_exit(0);  // no destructor: the segment's closed flag is never set
  }
  const std::string rank1 = receive(to_parent[0]);
  const bool mapped = mine->map_peers({mine->published(), rank1}, {{parent}, {child}});
  send(to_child[1], mine->published());
  const std::string child_mapped = receive(to_parent[0]);

  std::string failure;
  const auto started = std::chrono::steady_clock::now();
  if (mapped && child_mapped == "mapped") {
    std::vector<float> in(1000, 1.0f), out(1000);
    shared_memory_channel::reduction sum;
    sum.combine = cohort::detail::reduce_function(cohort::dtype::float32, op::sum);
    sum.divided = cohort::detail::sum_divided_function(cohort::dtype::float32);
    try {
      mine->all_reduce(in.data(), out.data(), in.size(), sizeof(float), sum, 1, 10s);
    } catch (const cohort::detail::shared_memory_failure& ended) {
      failure = ended.what();
    }
  }
  const auto took = std::chrono::steady_clock::now() - started;
  int status = 0;
  ::waitpid(child, &status, 0);
  for (int fd : {to_child[0], to_child[1], to_parent[0], to_parent[1]}) ::close(fd);
  REQUIRE(mapped);
  REQUIRE(child_mapped == "mapped");
  INFO(failure);
  CHECK(failure.find("rank 1's process is gone") != std::string::npos);
  CHECK(took < 5s);  // the group's timeout is 10 s
}

namespace {

// Values near 20000 (three of them overflow float16's 65504) and small ones with fractions,
// in every 16-bit float: sums that round, and averages that must not overflow.
template <class T>
std::vector<T> near_the_limit(int rank, std::size_t n) {
  std::vector<T> values(n);
  for (std::size_t i = 0; i < n; ++i) {
    const auto r = static_cast<std::size_t>(rank);
    const float large = 20000.0f + static_cast<float>((r * 37 + i * 11) % 256) * 16.0f;
    const float small = 1.0f + static_cast<float>((r * 13 + i * 7) % 1000) / 1024.0f;
    values[i] = T(i % 3 == 0 ? small : large);
  }
  return values;
}

template <class T>
void compare_transports(group& shm, group& tcp, int rank, int world) {
  // 1000 elements: one phase; 70000: the chunked path.
  for (const std::size_t n : {std::size_t{1000}, std::size_t{70000}})
    for (const op reduction : {op::avg, op::sum}) {
      const auto in = near_the_limit<T>(rank, n);
      std::vector<T> through_shm(n), through_tcp(n);
      shm.all_reduce(std::span<const T>(in), std::span<T>(through_shm), reduction).wait();
      tcp.all_reduce(std::span<const T>(in), std::span<T>(through_tcp), reduction).wait();
      std::size_t differ = 0, nonfinite = 0;
      for (std::size_t i = 0; i < n; ++i) {
        differ += through_shm[i].bits != through_tcp[i].bits;
        nonfinite += !std::isfinite(static_cast<float>(through_shm[i]));
      }
      RANK_CHECK(differ == 0, "all_reduce " << (reduction == op::avg ? "avg" : "sum") << " of " << n << ": " << differ
                                            << " elements differ between shared memory and TCP");
      if (reduction == op::avg)
        RANK_CHECK(nonfinite == 0, "the average of " << n << " overflowed in " << nonfinite << " elements");
      // reduce_scatter: every rank's block of `in` repeated, the own block in place.
      std::vector<T> blocks;
      for (int r = 0; r < world; ++r) blocks.insert(blocks.end(), in.begin(), in.end());
      std::vector<T> in_place = blocks, mine(n);
      const std::size_t own = static_cast<std::size_t>(rank) * n;
      shm.reduce_scatter(std::span<const T>(in_place), std::span<T>(in_place.data() + own, n), reduction).wait();
      tcp.reduce_scatter(std::span<const T>(blocks), std::span<T>(mine), reduction).wait();
      differ = 0;
      for (std::size_t i = 0; i < n; ++i) differ += in_place[own + i].bits != mine[i].bits;
      RANK_CHECK(differ == 0, "reduce_scatter of " << n << ": " << differ << " elements differ");
    }
}

}  // namespace

TEST_CASE("16-bit float sums and averages give the same bits through shared memory and TCP", "[shared_memory][gloo]") {
  for (int world : {2, 3}) {
    auto shm_store = std::make_shared<cohort::memory_store>();
    auto tcp_store = std::make_shared<cohort::memory_store>();
    cohort_test::run_ranks(world, [&](int rank) {
      auto shm = make_group(shm_store, rank, world, true, 10s);
      auto tcp = make_group(tcp_store, rank, world, false, 10s);
      RANK_CHECK(shm.backend().uses_shared_memory() && !tcp.backend().uses_shared_memory(), "transports");
      compare_transports<cohort::half>(shm, tcp, rank, world);
      compare_transports<cohort::bfloat16>(shm, tcp, rank, world);
    });
  }
}

// Rank 0's all-gather input sits in rank 1's block of its own output, and rank 1's
// all-reduce output overlaps its input one element on: local facts that once sent that rank
// to Gloo while the others met in shared memory, each waiting for the other until the
// timeout. Both stay on the group's transport, and the results are the ones without overlap.
TEST_CASE("a rank whose buffers overlap oddly stays on the group's transport", "[shared_memory][gloo][faults]") {
  constexpr int world = 3;
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world, true, 5s);
    RANK_CHECK(pg.backend().uses_shared_memory(), "the group should use shared memory");
    for (const std::size_t n : {std::size_t{100}, std::size_t{300000}}) {
      std::vector<float> gathered(world * n, -1.0f), own(n);
      for (std::size_t i = 0; i < n; ++i) own[i] = contribution(rank, i);
      std::span<const float> input(own);
      if (rank == 0) {  // inside rank 1's block
        std::copy(own.begin(), own.end(), gathered.begin() + static_cast<long>(n));
        input = std::span<const float>(gathered.data() + n, n);
      }
      pg.all_gather(input, std::span<float>(gathered)).wait();
      std::size_t wrong = 0;
      for (std::size_t r = 0; r < world; ++r)
        for (std::size_t i = 0; i < n; ++i) wrong += gathered[r * n + i] != contribution(static_cast<int>(r), i);
      RANK_CHECK(wrong == 0, "all_gather of " << n << ": " << wrong << " elements off");

      std::vector<float> buffer(n + 1, -1.0f), summed(n + 1);
      for (std::size_t i = 0; i < n; ++i) buffer[i] = contribution(rank, i);
      float* out = rank == 1 ? buffer.data() + 1 : summed.data();  // one element on
      pg.all_reduce(std::span<const float>(buffer.data(), n), std::span<float>(out, n), op::sum).wait();
      wrong = 0;
      for (std::size_t i = 0; i < n; ++i)
        wrong += out[i] != contribution(0, i) + contribution(1, i) + contribution(2, i);
      RANK_CHECK(wrong == 0, "all_reduce of " << n << " with overlapping buffers: " << wrong << " elements off");
    }
  });
}

// Small (one-phase) and chunked all-reduces back to back, with one rank late now and then:
// a rank may run a phase ahead into the next call (its next small slot, its next call's
// signature) while a slower one still reads this call's.
TEST_CASE("small and chunked all-reduces interleave with a late rank", "[shared_memory][gloo]") {
  constexpr int world = 3;
  auto store = std::make_shared<cohort::memory_store>();
  cohort_test::run_ranks(world, [&](int rank) {
    auto pg = make_group(store, rank, world, true, 10s);
    const std::size_t chunk = cohort::detail::shared_memory_channel::default_slot_bytes / sizeof(float);
    const std::vector<std::size_t> sizes = {7, 16384, 16385, 3, chunk + 5, 1, 2, 500, chunk / 2, 9};
    for (int round = 0; round < 20; ++round)
      for (std::size_t call = 0; call < sizes.size(); ++call) {
        const std::size_t n = sizes[call];
        if (rank == (round + static_cast<int>(call)) % world && call % 3 == 0)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        std::vector<float> values(n);
        for (std::size_t i = 0; i < n; ++i) values[i] = contribution(rank, i + call);
        pg.all_reduce(std::span<float>(values), op::sum).wait();
        std::size_t wrong = 0;
        for (std::size_t i = 0; i < n; ++i)
          wrong += values[i] != contribution(0, i + call) + contribution(1, i + call) + contribution(2, i + call);
        RANK_CHECK(wrong == 0, "round " << round << ", call " << call << " (" << n << "): " << wrong << " off");
      }
  });
}
