// Main-process guards on 3 Gloo ranks as threads: main-first ordering (seen through a shared
// log with sequence numbers), on_main and its collective check, rank-aware logging, printf
// on stdout (in order with the trainer's own printf, lines whole across threads), and an
// atomic write that a concurrent reader never sees half-done.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include "cohort/detail/files.hpp"
#include "cohort/rendezvous/launch.hpp"
#include "cohort/run/atomic_write.hpp"
#include "cohort/run/guards.hpp"
#include "cohort/run/logging.hpp"
#include "support.hpp"

#if __has_include(<gloo/context.h>)
#include "cohort/comm/gloo.hpp"
#include "cohort/comm/process_group.hpp"
#endif

using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

// A group without collectives: enough for the rank predicates and on_main.
struct plain_group {
  int my_rank = 0, my_size = 1, my_local_rank = 0, my_local_size = 1;
  int rank() const { return my_rank; }
  int world_size() const { return my_size; }
  int local_rank() const { return my_local_rank; }
  int local_size() const { return my_local_size; }
};

// Entries appended by many threads, each stamped with a global sequence number.
struct sequence_log {
  std::mutex mutex;
  std::uint64_t next = 0;
  std::vector<std::pair<std::uint64_t, int>> entries;  // (sequence, rank)
  void add(int rank) {
    std::lock_guard lock(mutex);
    entries.emplace_back(next++, rank);
  }
};

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A fresh directory per test case (each case is its own process under ctest).
fs::path scratch_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() / ("cohort-guards-" + name + "-" +
                                          std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
  fs::create_directories(dir);
  return dir;
}

std::string pattern(std::size_t bytes, char seed) {
  std::string text(bytes, ' ');
  for (std::size_t i = 0; i < bytes; ++i)
    text[i] = static_cast<char>('a' + (static_cast<std::size_t>(seed) + i * 7) % 26);
  return text;
}

#if __has_include(<gloo/context.h>)
using group = cohort::process_group<cohort::gloo>;

group make_group(const std::shared_ptr<cohort::memory_store>& store, const cohort::launch_env& env,
                 bool debug = false) {
  cohort::gloo::options opts;
  opts.timeout = 20s;
  opts.debug_checks = debug;
  return group(store, env, opts);
}
#define COHORT_REQUIRE_GLOO() (void)0
#else
#define COHORT_REQUIRE_GLOO() cohort_test::skip("built without Gloo (apt-get install libgloo-dev)")
#endif

}  // namespace

TEST_CASE("guards: main and local-main predicates", "[guards]") {
  for (int rank = 0; rank < 4; ++rank) {
    plain_group g{rank, 4, rank % 2, 2};
    CHECK(cohort::is_main_process(g) == (rank == 0));
    CHECK(cohort::is_local_main_process(g) == (rank % 2 == 0));
  }
}

TEST_CASE("guards: on_main runs on rank 0 only and returns its result there", "[guards]") {
  int calls = 0;
  for (int rank = 0; rank < 3; ++rank) {
    plain_group g{rank, 3};
    const std::optional<int> answer = cohort::on_main(g, [&] {
      ++calls;
      return 42;
    });
    CHECK(answer.has_value() == (rank == 0));
    if (answer) CHECK(*answer == 42);
    cohort::on_main(g, [&] { ++calls; });  // void result
  }
  CHECK(calls == 2);
}

TEST_CASE("guards: main_process_first lets rank 0 finish before the others start", "[guards][gloo]") {
  COHORT_REQUIRE_GLOO();
#if __has_include(<gloo/context.h>)
  auto store = std::make_shared<cohort::memory_store>();
  sequence_log log;
  const auto dir = scratch_dir("main-first");
  const auto cache = dir / "dataset.bin";
  std::vector<std::string> seen(3);
  cohort_test::run_ranks(3, [&](int rank) {
    auto pg = make_group(store, cohort::launch_env::explicit_ranks(rank, 3));
    cohort::main_process_first(pg, [&] {
      log.add(rank);
      if (cohort::is_main_process(pg)) {
        std::this_thread::sleep_for(50ms);  // a slow download: the others must still wait
        cohort::atomic_write_file(cache, "downloaded once");
      }
      seen[static_cast<std::size_t>(rank)] = read_file(cache);
      log.add(rank);
    });
  });
  REQUIRE(log.entries.size() == 6);
  // Rank 0's two entries (start, end) come before every other rank's first entry.
  std::uint64_t main_last = 0, others_first = UINT64_MAX;
  for (auto [sequence, rank] : log.entries) {
    if (rank == 0)
      main_last = std::max(main_last, sequence);
    else
      others_first = std::min(others_first, sequence);
  }
  CHECK(main_last == 1);
  CHECK(others_first == 2);
  for (const auto& text : seen) CHECK(text == "downloaded once");
  fs::remove_all(dir);
#endif
}

TEST_CASE("guards: local_main_process_first runs each node's local rank 0 first", "[guards][gloo]") {
  COHORT_REQUIRE_GLOO();
#if __has_include(<gloo/context.h>)
  auto store = std::make_shared<cohort::memory_store>();
  sequence_log log;
  // Two "nodes" of two ranks: ranks 0 and 1 on node 0, ranks 2 and 3 on node 1.
  cohort_test::run_ranks(4, [&](int rank) {
    auto pg = make_group(store, cohort::launch_env::explicit_values(rank, 4, rank % 2, 2));
    cohort::local_main_process_first(pg, [&] {
      if (cohort::is_local_main_process(pg)) std::this_thread::sleep_for(30ms);
      log.add(rank);
    });
  });
  REQUIRE(log.entries.size() == 4);
  std::uint64_t leaders_last = 0, followers_first = UINT64_MAX;
  for (auto [sequence, rank] : log.entries) {
    if (rank % 2 == 0)
      leaders_last = std::max(leaders_last, sequence);
    else
      followers_first = std::min(followers_first, sequence);
  }
  CHECK(leaders_last < followers_first);
#endif
}

TEST_CASE("guards: a failure on rank 0 in main_process_first reaches every rank", "[guards][gloo]") {
  COHORT_REQUIRE_GLOO();
#if __has_include(<gloo/context.h>)
  auto store = std::make_shared<cohort::memory_store>();
  std::atomic<int> followers_ran{0};
  std::vector<std::string> errors(3);
  cohort_test::run_ranks(3, [&](int rank) {
    auto pg = make_group(store, cohort::launch_env::explicit_ranks(rank, 3));
    try {
      cohort::main_process_first(pg, [&] {
        if (rank == 0) throw std::runtime_error("mirror unreachable");
        ++followers_ran;
      });
    } catch (const std::exception& e) {
      errors[static_cast<std::size_t>(rank)] = e.what();
    }
  });
  CHECK(followers_ran == 0);
  CHECK(errors[0] == "mirror unreachable");  // rank 0 gets its own exception back
  for (int rank = 1; rank < 3; ++rank) {
    INFO(errors[static_cast<std::size_t>(rank)]);
    CHECK(errors[static_cast<std::size_t>(rank)].find("rank 0 failed: mirror unreachable") != std::string::npos);
  }
#endif
}

TEST_CASE("guards: a collective inside on_main is caught instead of deadlocking", "[guards][gloo]") {
  COHORT_REQUIRE_GLOO();
#if __has_include(<gloo/context.h>)
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::string> errors(3);
  std::atomic<int> after{0};
  cohort_test::run_ranks(3, [&](int rank) {
    auto pg = make_group(store, cohort::launch_env::explicit_ranks(rank, 3), /*debug=*/true);
    try {
      cohort::on_main(pg, [&] {
        std::int32_t value = 1;
        pg.all_reduce(std::span<std::int32_t>(&value, 1)).wait();  // only rank 0 is here
      });
    } catch (const cohort::error& e) {
      errors[static_cast<std::size_t>(rank)] = e.what();
    }
    // The group is still usable by everyone afterwards: no rank is stuck in a collective.
    pg.barrier().wait();
    ++after;
  });
  INFO(errors[0]);
  CHECK(errors[0].find("on_main") != std::string::npos);
  CHECK(errors[1].empty());
  CHECK(errors[2].empty());
  CHECK(after == 3);
#endif
}

TEST_CASE("guards: rank-aware logging prints from main only unless asked", "[guards]") {
  std::mutex mutex;
  std::vector<std::string> lines;
  auto console = [&](std::string_view line) {
    std::lock_guard lock(mutex);
    lines.emplace_back(line);
  };
  const auto dir = scratch_dir("logs");

  cohort_test::run_ranks(3, [&](int rank) {
    plain_group g{rank, 3};
    cohort::rank_logger log{g, {.directory = dir, .console = console}};
    log("step ", 7, " loss ", 0.5);
  });
  REQUIRE(lines.size() == 1);
  CHECK(lines[0] == "[rank 0/3] step 7 loss 0.5");
  // Every rank, main or not, keeps its own file.
  for (int rank = 0; rank < 3; ++rank)
    CHECK(read_file(dir / ("rank-" + std::to_string(rank) + ".log")) ==
          "[rank " + std::to_string(rank) + "/3] step 7 loss 0.5\n");

  lines.clear();
  cohort_test::run_ranks(3, [&](int rank) {
    cohort::rank_logger log{rank, 3, {.all_ranks = true, .console = console}};
    log.log("hello");
  });
  std::sort(lines.begin(), lines.end());
  CHECK(lines == std::vector<std::string>{"[rank 0/3] hello", "[rank 1/3] hello", "[rank 2/3] hello"});
  fs::remove_all(dir);
}

namespace {
// Runs fn with stdout (its FILE and file descriptor 1) going to a file; returns what was written.
std::string capture_stdout(const std::function<void()>& fn) {
  const auto path = scratch_dir("stdout") / "stdout.txt";
  std::fflush(stdout);
  const int saved = ::dup(1);
  const int file = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  REQUIRE(saved >= 0);
  REQUIRE(file >= 0);
  ::dup2(file, 1);
  ::close(file);
  try {
    fn();
  } catch (...) {
    std::fflush(stdout);
    ::dup2(saved, 1);
    ::close(saved);
    throw;
  }
  std::fflush(stdout);
  ::dup2(saved, 1);
  ::close(saved);
  auto text = read_file(path);
  fs::remove_all(path.parent_path());
  return text;
}
}  // namespace

TEST_CASE("guards: main_printf prints on rank 0 only, in order with the trainer's own printf", "[guards]") {
  const plain_group first{0, 3}, second{1, 3}, third{2, 3};
  const std::string long_word(700, 'x');  // past the formatting's first buffer
  const auto text = capture_stdout([&] {
    for (int step = 0; step < 3; ++step) {
      std::printf("trainer step %d\n", step);  // the trainer's own lines, buffered in stdout
      for (const auto* group : {&first, &second, &third})
        cohort::main_printf(*group, "step %d loss %.4f\n", step, 0.25 * step);
    }
    cohort::printf_on(third, 2, "only rank %d\n", third.rank());
    cohort::printf_on(first, 2, "not rank %d\n", first.rank());
    cohort::main_printf(cohort::launch_env::explicit_ranks(0, 3), "from the %s\n", "environment");
    cohort::main_printf(cohort::launch_env::explicit_ranks(1, 3), "never\n");
    cohort::main_printf(first, "no newline");  // ended by one: every call prints whole lines
    cohort::main_printf(first, "%s\n", long_word.c_str());
    std::printf("trainer done\n");
  });
  CHECK(text ==
        "trainer step 0\nstep 0 loss 0.0000\n"
        "trainer step 1\nstep 1 loss 0.2500\n"
        "trainer step 2\nstep 2 loss 0.5000\n"
        "only rank 2\nfrom the environment\nno newline\n" +
            long_word + "\ntrainer done\n");
}

TEST_CASE("guards: rank_printf prefixes every line and keeps lines whole across rank threads", "[guards]") {
  constexpr int world = 4, lines_per_rank = 200;
  const std::string payload(300, '=');
  const auto text = capture_stdout([&] {
    cohort_test::run_ranks(world, [&](int rank) {
      const plain_group group{rank, world};
      for (int i = 0; i < lines_per_rank; ++i) cohort::rank_printf(group, "line %d %s\n", i, payload.c_str());
      cohort::rank_printf(group, "two\nlines\n");
    });
  });
  std::vector<int> next(world, 0);
  std::vector<int> two(world, 0);
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    int rank = -1, index = -1;
    char rest[400] = {};
    if (std::sscanf(line.c_str(), "[rank %d] line %d %399s", &rank, &index, rest) == 3) {
      INFO(line);
      REQUIRE(rank >= 0);
      REQUIRE(rank < world);
      CHECK(index == next[static_cast<std::size_t>(rank)]++);  // whole, and in each rank's order
      CHECK(std::string(rest) == payload);
      CHECK(line == "[rank " + std::to_string(rank) + "] line " + std::to_string(index) + " " + payload);
    } else {
      INFO(line);
      REQUIRE(std::sscanf(line.c_str(), "[rank %d]", &rank) == 1);
      REQUIRE(rank >= 0);
      REQUIRE(rank < world);
      const auto prefix = "[rank " + std::to_string(rank) + "] ";
      CHECK((line == prefix + "two" || line == prefix + "lines"));
      ++two[static_cast<std::size_t>(rank)];
    }
  }
  CHECK(next == std::vector<int>(world, lines_per_rank));
  CHECK(two == std::vector<int>(world, 2));
}

TEST_CASE("guards: a reader concurrent with the atomic write never sees a partial file", "[guards][gloo]") {
  COHORT_REQUIRE_GLOO();
#if __has_include(<gloo/context.h>)
  const auto dir = scratch_dir("atomic");
  const auto target = dir / "checkpoint.bin";
  const std::string old_contents = pattern(1 << 20, 'o');
  const std::string new_contents = pattern(4 << 20, 'n');
  cohort::atomic_write_file(target, old_contents);

  // A reader polling the target while the writer works. Records anything that is neither the
  // complete old file nor the complete new one.
  std::atomic<bool> stop{false};
  std::atomic<int> reads{0}, partial{0}, saw_new{0};
  auto reader = [&] {
    while (!stop) {
      const auto text = read_file(target);
      ++reads;
      if (text == new_contents)
        ++saw_new;
      else if (text != old_contents)
        ++partial;
    }
  };

  // Control: a plain, non-atomic write in slow chunks is caught by this reader, which shows
  // the check can fail. A handshake (not a sleep) makes sure the reader looks mid-write.
  {
    const auto control = dir / "control.bin";
    std::atomic<int> control_partial{0};
    std::atomic<bool> first_chunk_written{false}, looked{false};
    std::thread control_reader([&] {
      while (!first_chunk_written) std::this_thread::yield();
      const auto text = read_file(control);
      if (text != new_contents) ++control_partial;
      looked = true;
    });
    {
      std::ofstream out(control, std::ios::binary | std::ios::trunc);
      out.write(new_contents.data(), 1 << 16);
      out.flush();
      first_chunk_written = true;
      while (!looked) std::this_thread::yield();
      out.write(new_contents.data() + (1 << 16), static_cast<std::streamsize>(new_contents.size() - (1 << 16)));
    }
    control_reader.join();
    CHECK(control_partial == 1);
  }

  std::thread watcher(reader);
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::string> after_write(3);
  cohort_test::run_ranks(3, [&](int rank) {
    auto pg = make_group(store, cohort::launch_env::explicit_ranks(rank, 3));
    cohort::atomic_write_on_main(pg, target, [&](std::ostream& out) {
      // Slow, chunked writing gives the reader every chance to look mid-write.
      for (std::size_t at = 0; at < new_contents.size(); at += 1 << 16) {
        out.write(new_contents.data() + at, 1 << 16);
        out.flush();
        if (at % (1 << 19) == 0) std::this_thread::sleep_for(5ms);
      }
    });
    // Once the collective returns, every rank sees the whole new file.
    after_write[static_cast<std::size_t>(rank)] = read_file(target);
  });
  // Let the reader see the final state a few more times, then stop it.
  const int reads_at_end = reads;
  while (reads < reads_at_end + 3) std::this_thread::yield();
  stop = true;
  watcher.join();

  INFO("reads: " << reads << ", partial: " << partial);
  CHECK(partial == 0);
  CHECK(saw_new > 0);
  for (const auto& text : after_write) CHECK(text == new_contents);
  // No temporary file is left behind.
  std::size_t files = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(dir)) ++files;
  CHECK(files == 2);  // checkpoint.bin and control.bin
  fs::remove_all(dir);
#endif
}

TEST_CASE("guards: a failing atomic write leaves the old file and tells every rank", "[guards][gloo]") {
  COHORT_REQUIRE_GLOO();
#if __has_include(<gloo/context.h>)
  const auto dir = scratch_dir("atomic-fail");
  const auto target = dir / "results.json";
  cohort::atomic_write_file(target, "{\"old\": true}");
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::string> errors(3);
  cohort_test::run_ranks(3, [&](int rank) {
    auto pg = make_group(store, cohort::launch_env::explicit_ranks(rank, 3));
    try {
      cohort::atomic_write_on_main(pg, target, [](std::ostream& out) {
        out << "{\"new\": ";
        throw std::runtime_error("serializer failed");
      });
    } catch (const std::exception& e) {
      errors[static_cast<std::size_t>(rank)] = e.what();
    }
  });
  CHECK(read_file(target) == "{\"old\": true}");
  CHECK(errors[0] == "serializer failed");
  CHECK(errors[1].find("serializer failed") != std::string::npos);
  CHECK(errors[2].find("serializer failed") != std::string::npos);
  std::size_t files = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(dir)) ++files;
  CHECK(files == 1);
  CHECK_THROWS_AS(cohort::atomic_write_file(dir / "missing-dir" / "x.bin", "data"), cohort::error);
  fs::remove_all(dir);
#endif
}

// The POSIX helpers the checkpoint, the stores and logging use in place of <filesystem>: a
// missing level is made, a file in the way refused, and a tree's removal never follows a link
// out of it (a checkpoint's pruning must not delete what a link in it points to).
TEST_CASE("guards: the file helpers make every missing level and remove a tree without following its links",
          "[guards]") {
  const auto dir = scratch_dir("files");
  const std::string nested = (dir / "a" / "b" / "c").string();
  CHECK_FALSE(cohort::detail::make_directories(nested));
  CHECK(fs::is_directory(nested));
  CHECK_FALSE(cohort::detail::make_directories(nested + "/"));  // there already: no error
  std::ofstream(dir / "a" / "file") << "x";
  CHECK(cohort::detail::make_directories((dir / "a" / "file" / "d").string()) == std::errc::not_a_directory);
  const auto outside = dir / "outside";
  fs::create_directories(outside);
  std::ofstream(outside / "kept") << "y";
  fs::create_directory_symlink(outside, dir / "a" / "b" / "link");
  CHECK_FALSE(cohort::detail::remove_tree((dir / "a").string()));
  CHECK_FALSE(fs::exists(dir / "a"));
  CHECK(read_file(outside / "kept") == "y");
  CHECK_FALSE(cohort::detail::remove_tree((dir / "a").string()));  // nothing there: no error
  CHECK(cohort::detail::path_in("d/", "n") == "d/n");
  CHECK(cohort::detail::path_in("", "n") == "n");
  CHECK(cohort::detail::path_in("d", "/abs") == "/abs");
  CHECK(cohort::detail::parent_directory("n.json") == ".");
  CHECK(cohort::detail::parent_directory("d/n.json") == "d/");
  fs::remove_all(dir);
}
