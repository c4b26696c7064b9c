// The flight recorder, trace files, COHORT_DEBUG's point-to-point check and the watchdog:
// the ring on its own, then real Gloo ranks (threads over loopback, or a child process
// where the watchdog ends the process) that fail in ways where the ranks differ.
#include <sys/wait.h>
#include <unistd.h>
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cohort/comm/detail/background_abort.hpp>
#include <cohort/comm/detail/failure_report.hpp>
#include <cohort/comm/gloo.hpp>
#include <cohort/comm/process_group.hpp>
#include <cohort/diagnostics/trace.hpp>
#include <cohort/tools/detail/json.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support.hpp"

using namespace std::chrono_literals;
using cohort::call_kind;
using cohort::call_record;
using cohort::call_state;
using group = cohort::process_group<cohort::gloo>;

namespace {

call_record collective(std::uint64_t sequence, std::size_t count = 8) {
  call_record call;
  call.kind = call_kind::all_reduce;
  call.sequence = sequence;
  call.type = cohort::dtype::float32;
  call.count = count;
  return call;
}

// A directory of its own under the build tree, emptied first.
std::filesystem::path scratch_dir(const std::string& name) {
  const auto dir = std::filesystem::path(COHORT_TEST_BINARY_DIR) / "flight_recorder" / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

group make_group(const std::shared_ptr<cohort::store>& store, int rank, int world, cohort::gloo::options opts) {
  return group(store, cohort::launch_env::explicit_ranks(rank, world), opts);
}

}  // namespace

TEST_CASE("the ring keeps the last calls in order, with their states and times", "[flight_recorder]") {
  cohort::flight_recorder recorder(4);
  std::vector<std::uint64_t> ids;
  for (std::uint64_t s = 1; s <= 6; ++s) ids.push_back(recorder.issued(collective(s)));
  recorder.started(ids[4]);
  recorder.completed(ids[4], 5);
  recorder.started(ids[5]);
  recorder.failed(ids[5]);
  recorder.completed(ids[0], 1);  // overwritten long ago: must not touch the slot's new owner

  const auto calls = recorder.snapshot();
  REQUIRE(calls.size() == 4);
  for (std::size_t k = 0; k < calls.size(); ++k) CHECK(calls[k].sequence == k + 3);
  CHECK(calls[0].state == call_state::issued);
  CHECK(calls[0].completed_us == 0);
  CHECK(calls[2].state == call_state::completed);
  CHECK(calls[2].started_us >= calls[2].issued_us);
  CHECK(calls[2].completed_us >= calls[2].started_us);
  CHECK(calls[3].state == call_state::failed);
  CHECK(recorder.last_issued() == 6);
  CHECK(recorder.last_completed() == 5);

  // Point-to-point calls have sequences of their own: they do not move the collective marks.
  call_record send = collective(99);
  send.kind = call_kind::send;
  send.peer = 1;
  recorder.completed(recorder.issued(send), 0);
  CHECK(recorder.last_issued() == 6);
  CHECK(recorder.last_completed() == 5);

  // A collective that completes after the ring recycled its slot still counts as completed.
  cohort::flight_recorder small(2);
  const auto first = small.issued(collective(1));
  small.issued(collective(2));
  small.issued(collective(3));
  small.completed(first, 1);
  CHECK(small.last_completed() == 1);
  CHECK(small.snapshot().front().sequence == 2);

  cohort::flight_recorder off(0);
  CHECK_FALSE(off.enabled());
  CHECK(off.issued(collective(1)) == 0);
  CHECK(off.snapshot().empty());
}

TEST_CASE("calls are described the way errors name them", "[flight_recorder]") {
  CHECK(cohort::detail::describe(collective(7, 4096)) == "all_reduce #7 (float x 4096, sum)");
  call_record root = collective(2, 4);
  root.kind = call_kind::broadcast;
  root.type = cohort::dtype::int32;
  root.peer = 1;
  CHECK(cohort::detail::describe(root) == "broadcast #2 (int32 x 4, root 1)");
  call_record recv = collective(1, 3);
  recv.kind = call_kind::recv;
  recv.peer = 2;
  recv.tag = 5;
  CHECK(cohort::detail::describe(recv) == "recv #1 (float x 3, peer 2, tag 5)");
}

TEST_CASE("a failed collective writes every failing rank's ring, and the silent rank writes none",
          "[flight_recorder][gloo][faults]") {
  const auto dir = scratch_dir("skipped");
  auto store = std::make_shared<cohort::memory_store>();
  std::atomic<int> failed{0};
  cohort_test::run_ranks(3, [&](int rank) {
    cohort::gloo::options opts;
    opts.timeout = 2s;
    opts.trace_dir = dir.string();
    auto pg = make_group(store, rank, 3, opts);
    std::vector<float> data(1000, 1.0f);
    pg.all_reduce(std::span<float>(data)).wait();
    pg.broadcast(std::span<float>(data), 1).wait();
    if (rank == 2) {
      cohort_test::wait_for_count(failed, 2, 12s);  // past the others' timeout and report window
      return;
    }
    // Rank 2 cannot say what it does: unknown, not accused (its missing trace says the rest).
    RANK_CHECK_THROWS(cohort::timeout_error, pg.all_reduce(std::span<float>(data)).wait(),
                      "rank 2 is unknown (no report");
    ++failed;
  });
  REQUIRE_FALSE(std::filesystem::exists(dir / "rank2.pg1.json"));
  for (int rank = 0; rank < 2; ++rank) {
    const auto path = dir / ("rank" + std::to_string(rank) + ".pg1.json");
    INFO(path);
    REQUIRE(std::filesystem::exists(path));
    const auto trace = cohort::detail::parse_json(read_file(path));
    CHECK(trace.at("version").as_number() == 1);
    CHECK(trace.at("group").as_string() == "pg1");
    CHECK(trace.at("backend").as_string() == "gloo");
    CHECK(trace.at("rank").as_number() == rank);
    CHECK(trace.at("world").as_number() == 3);
    CHECK(trace.at("last_issued").as_number() == 3);
    CHECK(trace.at("last_completed").as_number() == 2);
    CHECK_THAT(trace.at("error").as_string(),
               Catch::Contains("rank 2 is unknown") && Catch::Contains("in all_reduce #3 (float x 1000, sum)"));
    const auto& entries = trace.at("entries").as_array();
    REQUIRE(entries.size() == 3);
    CHECK(entries[1].at("kind").as_string() == "broadcast");
    CHECK(entries[1].at("peer").as_number() == 1);
    CHECK(entries[1].at("state").as_string() == "completed");
    CHECK(entries[2].at("sequence").as_number() == 3);
    CHECK(entries[2].at("kind").as_string() == "all_reduce");
    CHECK(entries[2].at("dtype").as_string() == "float");
    CHECK(entries[2].at("count").as_number() == 1000);
    CHECK(entries[2].at("state").as_string() == "failed");
    CHECK(entries[2].at("completed_us").as_number() >= entries[2].at("started_us").as_number());
  }
  // cohort-trace, reading the same files, names the same culprit.
  const auto report = cohort::analyze_traces(dir);
  REQUIRE(report.groups.size() == 1);
  const auto& pg1 = report.groups[0];
  CHECK(pg1.missing == std::vector<int>{2});
  REQUIRE_FALSE(pg1.findings.empty());
  INFO(cohort::format_trace_report(report));
  CHECK(pg1.findings[0].culprits == std::vector<int>{2});
  CHECK(pg1.findings[0].sequence == 3);
  CHECK_THAT(pg1.findings[0].text, Catch::Contains("all_reduce #3 (float x 1000, sum)"));
}

TEST_CASE("COHORT_DEBUG: a send and a recv of other sizes are named on both ranks, well within the timeout",
          "[flight_recorder][gloo][faults][debug]") {
  const auto dir = scratch_dir("p2p");
  auto store = std::make_shared<cohort::memory_store>();
  std::vector<std::string> messages(2);
  const auto started = std::chrono::steady_clock::now();
  cohort_test::run_ranks(2, [&](int rank) {
    cohort::gloo::options opts;
    opts.timeout = 30s;  // the check must not need it
    opts.debug_checks = true;
    opts.trace_dir = dir.string();
    auto pg = make_group(store, rank, 2, opts);
    std::vector<float> data(100, 1.0f);
    // A matched pair first: the check passes it and the data arrives.
    if (rank == 0)
      pg.send(std::span<float>(data), 1, 3).wait();
    else
      pg.recv(std::span<float>(data), 0, 3).wait();
    try {
      if (rank == 0)
        pg.send(std::span<float>(data), 1, 3).wait();
      else
        pg.recv(std::span<float>(data).first(50), 0, 3).wait();
      throw cohort_test::rank_failure("mismatched pair completed");
    } catch (const cohort::error& failure) {
      messages[static_cast<std::size_t>(rank)] = failure.what();
    }
  });
  RANK_CHECK(std::chrono::steady_clock::now() - started < 10s);
  for (const auto& text : messages) {
    INFO(text);
    CHECK_THAT(text, Catch::Contains("rank 0 sends float x 100 to rank 1 (tag 3, #2) but rank 1's matching recv "
                                     "expects float x 50"));
  }
  CHECK_THAT(messages[0], Catch::Contains("send #2 (float x 100, peer 1, tag 3)"));
  CHECK_THAT(messages[1], Catch::Contains("recv #2 (float x 50, peer 0, tag 3)"));
  const auto report = cohort::analyze_traces(dir);
  INFO(cohort::format_trace_report(report));
  REQUIRE(report.groups.size() == 1);
  bool named = false;
  for (const auto& finding : report.groups[0].findings)
    named = named || (finding.text.find("float x 100") != std::string::npos &&
                      finding.text.find("float x 50") != std::string::npos);
  CHECK(named);
}

TEST_CASE("COHORT_DEBUG: a send nobody receives names the silent peer", "[flight_recorder][gloo][faults][debug]") {
  auto store = std::make_shared<cohort::memory_store>();
  std::string message;
  cohort_test::run_ranks(2, [&](int rank) {
    cohort::gloo::options opts;
    opts.timeout = 2s;
    opts.debug_checks = true;
    auto pg = make_group(store, rank, 2, opts);
    std::vector<int> data(10, rank);
    if (rank == 1) {
      // Receives with another tag: never the pair of rank 0's send.
      RANK_CHECK_THROWS(cohort::timeout_error, pg.recv(std::span<int>(data), 0, 8).wait(), "never posted the send");
      return;
    }
    message = RANK_CHECK_THROWS(cohort::timeout_error, pg.send(std::span<int>(data), 1, 7).wait(),
                                "rank 1 never posted the recv matching this rank's send #1 to rank 1 (tag 7)");
  });
  INFO(message);
  CHECK_THAT(message, Catch::Contains("within 2 s"));
}

TEST_CASE("watchdog, throw_on_next_call: a collective that failed unwatched makes the next call throw",
          "[flight_recorder][gloo][faults][watchdog]") {
  auto store = std::make_shared<cohort::memory_store>();
  std::atomic<int> done{0};
  cohort_test::run_ranks(2, [&](int rank) {
    cohort::gloo::options opts;
    opts.timeout = 1s;
    opts.watchdog_interval = 100ms;
    opts.on_async_error = cohort::async_error_handling::throw_on_next_call;
    auto pg = make_group(store, rank, 2, opts);
    std::vector<float> data(64, 1.0f);
    if (rank == 0) {
      cohort_test::wait_for_count(done, 1, 12s);  // never joins; the group lives on until rank 1 is done
      return;
    }
    auto forgotten = pg.all_reduce(std::span<float>(data));  // fails after 1 s; never waited for
    (void)forgotten;
    std::this_thread::sleep_for(3500ms);  // timeout + report window + the watchdog's grace
    // The next call throws at once, with the first failure's message.
    RANK_CHECK_THROWS(cohort::timeout_error, pg.barrier(),
                      "rank 0 is unknown (no report within 1 s: computing, stopped, or blocked outside cohort");
    ++done;
  });
}

TEST_CASE("watchdog, abort_process: a failure nobody waits for ends the process with status 1 and says why",
          "[flight_recorder][gloo][faults][watchdog]") {
  const auto dir = scratch_dir("abort");
  const auto log = dir / "stderr.txt";
  std::fflush(nullptr);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    std::FILE* redirected = std::freopen(log.c_str(), "w", stderr);
    if (redirected == nullptr) std::_Exit(90);
    auto store = std::make_shared<cohort::memory_store>();
    try {
      cohort_test::run_ranks(2, [&](int rank) {
        cohort::gloo::options opts;
        opts.timeout = 1s;
        opts.watchdog_interval = 100ms;
        opts.trace_dir = dir.string();
        auto pg = make_group(store, rank, 2, opts);
        std::vector<float> data(64, 1.0f);
        if (rank == 1) {
          std::this_thread::sleep_for(20s);
          return;
        }
        auto forgotten = pg.all_reduce(std::span<float>(data));
        (void)forgotten;
        std::this_thread::sleep_for(20s);  // computing on, never waiting: the watchdog must act
      });
    } catch (...) {}
    std::_Exit(0);  // the watchdog did not act
  }
  int status = 0;
  const auto started = std::chrono::steady_clock::now();
  REQUIRE(::waitpid(child, &status, 0) == child);
  const auto elapsed = std::chrono::steady_clock::now() - started;
  const std::string text = read_file(log);
  INFO(text);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 1);
  CHECK(elapsed < 15s);
  CHECK_THAT(text, Catch::Contains("watchdog of group pg1") && Catch::Contains("rank 1 is unknown") &&
                       Catch::Contains("waiting in all_reduce #1 (float x 64, sum)") &&
                       Catch::Contains("ending the process"));
  CHECK(std::filesystem::exists(dir / "rank0.pg1.json"));
}

namespace {
// An engine abort that never returns until released: NCCL's, behind a kernel that never ends.
struct hanging_abort {
  std::shared_ptr<std::atomic<bool>> released = std::make_shared<std::atomic<bool>>(false);
  std::function<void()> call() const {
    return [released = released] {
      while (!released->load()) std::this_thread::sleep_for(1ms);
    };
  }
};
}  // namespace

TEST_CASE("an engine abort that hangs costs whoever aborts only its bounded wait", "[watchdog]") {
  hanging_abort hang;
  const auto started = std::chrono::steady_clock::now();
  CHECK_FALSE(cohort::detail::abort_in_background(hang.call(), 200ms));
  const auto waited = std::chrono::steady_clock::now() - started;
  CHECK(waited >= 200ms);
  CHECK(waited < 5s);
  CHECK_FALSE(cohort::detail::abort_in_background(hang.call(), 0ms));  // the watchdog's: no wait at all
  hang.released->store(true);
  bool ran = false;
  CHECK(cohort::detail::abort_in_background([&ran] { ran = true; }, 5s));  // a quick one is waited for
  CHECK(ran);
}

TEST_CASE("watchdog, abort_process: the process ends even when the engine's abort never returns", "[watchdog]") {
  std::fflush(nullptr);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    std::FILE* quiet = std::freopen("/dev/null", "w", stderr);
    if (quiet == nullptr) std::_Exit(90);
    hanging_abort hang;  // never released
    cohort::detail::watchdog dog(0, "pg1", cohort::async_error_handling::abort_process, 20ms, [&] {
      cohort::detail::abort_in_background(hang.call(), 0ms);
      return std::make_exception_ptr(cohort::error(0, "nccl.all_reduce", "overdue", "a peer never arrived"));
    });
    std::this_thread::sleep_for(20s);
    std::_Exit(0);  // the policy never acted
  }
  int status = 0;
  const auto started = std::chrono::steady_clock::now();
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 1);
  CHECK(std::chrono::steady_clock::now() - started < 5s);
}
