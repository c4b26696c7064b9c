// Ranks as real processes: children started with the environment a launcher would give them
// (torchrun, Open MPI, MPICH, Slurm) find each other through launch_env::detect() and the
// TCP store, and run collectives over Gloo; a rank that dies becomes an error on the others.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <cohort/comm/gloo.hpp>
#include <cohort/comm/process_group.hpp>
#include <cohort/diagnostics/trace.hpp>
#include <cohort/rendezvous/launch.hpp>
#include <cohort/rendezvous/tcp_store.hpp>
#include <cohort/run/run_ranks.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "support.hpp"

namespace {

std::uint16_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address);
  socklen_t length = sizeof address;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  ::close(fd);
  return ntohs(address.sin_port);
}

using environment = std::map<std::string, std::string>;

// Forks one child per environment; each child sets its variables, runs body() and exits
// with its return value (or 99 on an exception). Returns the exit codes; children still
// running after `limit` are killed and reported as -1. `in_order`: reaps them in rank order,
// as a launcher that waits for each child in turn does (a later one that ends first stays a
// zombie until those before it have ended). A child that stopped (stop_then_exit) is continued
// once every other child has ended: it holds nobody then, and a fixed wake-up time would have
// to outlast the others' slowest diagnosis (under a sanitizer) on every run.
std::vector<int> run_children(const std::vector<environment>& envs, const std::function<int()>& body,
                              std::chrono::seconds limit = std::chrono::seconds(60), bool in_order = false) {
  std::vector<pid_t> children;
  for (const auto& env : envs) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      for (const char* name :
           {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_USE_AGENT_STORE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "COHORT_RANK"})
        ::unsetenv(name);
      for (const auto& [name, value] : env) ::setenv(name.c_str(), value.c_str(), 1);
      int code = 99;
      try {
        code = body();
      } catch (const std::exception& failure) {
        std::fprintf(stderr, "child: %s\n", failure.what());
      }
      std::fflush(nullptr);
      ::_exit(code);
    }
    children.push_back(pid);
  }
  std::vector<int> codes(children.size(), -1);
  std::vector<bool> stopped(children.size(), false);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  std::size_t remaining = children.size();
  while (remaining > 0 && std::chrono::steady_clock::now() < deadline) {
    for (std::size_t i = 0; i < children.size(); ++i) {
      if (codes[i] != -1 || children[i] == 0) continue;
      if (in_order && i + remaining != children.size()) break;  // one before it still runs
      int status = 0;
      if (::waitpid(children[i], &status, WNOHANG | WUNTRACED) != children[i]) continue;
      if (WIFSTOPPED(status)) {
        stopped[i] = true;
        continue;
      }
      codes[i] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      children[i] = 0;
      stopped[i] = false;
      --remaining;
    }
    if (remaining > 0 && static_cast<std::size_t>(std::count(stopped.begin(), stopped.end(), true)) == remaining)
      for (std::size_t i = 0; i < children.size(); ++i)
        if (stopped[i]) {
          ::kill(children[i], SIGCONT);
          stopped[i] = false;
        }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (auto pid : children)
    if (pid != 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  return codes;
}

// What every launched rank does: detect, rendezvous, all-reduce rank+1, check the sum.
int sum_of_ranks() {
  const auto env = cohort::launch_env::detect();
  auto store = cohort::connect_store(env);
  cohort::gloo::options opts;
  opts.timeout = std::chrono::seconds(10);
  cohort::process_group<cohort::gloo> pg{store, env, opts};
  std::vector<double> value(1000, pg.rank() + 1.0);
  pg.all_reduce(std::span<double>(value)).wait();
  std::vector<double> gathered(static_cast<std::size_t>(pg.size()));
  std::vector<double> mine{static_cast<double>(pg.rank())};
  pg.all_gather(std::span<const double>(mine), std::span<double>(gathered)).wait();
  pg.barrier().wait();
  const double expected = pg.size() * (pg.size() + 1) / 2.0;
  bool ok = value[999] == expected;
  for (int r = 0; r < pg.size(); ++r) ok = ok && gathered[static_cast<std::size_t>(r)] == r;
  return ok ? 0 : 1;
}

// A fresh COHORT_TRACE_DIR for one test's ranks, and what cohort-trace makes of it afterwards.
std::string fresh_trace_dir(const std::string& name) {
  const auto dir = std::filesystem::path(COHORT_TEST_BINARY_DIR) / "multiprocess_traces" / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

// The ranks of the one group's first finding that the traces blame (the culprits).
void require_traces_blame(const std::string& dir, const std::vector<int>& culprits) {
  const auto report = cohort::analyze_traces(dir);
  INFO(cohort::format_trace_report(report));
  REQUIRE(report.groups.size() == 1);
  REQUIRE_FALSE(report.groups[0].findings.empty());
  CHECK(report.groups[0].missing == culprits);
  CHECK(report.groups[0].findings[0].culprits == culprits);
}

std::vector<environment> torchrun_envs(int launched, int world, const std::string& port) {
  std::vector<environment> envs;
  for (int r = 0; r < launched; ++r)
    envs.push_back({{"RANK", std::to_string(r)},
                    {"WORLD_SIZE", std::to_string(world)},
                    {"LOCAL_RANK", std::to_string(r)},
                    {"LOCAL_WORLD_SIZE", std::to_string(world)},
                    {"MASTER_ADDR", "127.0.0.1"},
                    {"MASTER_PORT", port}});
  return envs;
}

// A Gloo group over the launcher's environment and store, as a launched trainer makes one.
cohort::process_group<cohort::gloo> launched_gloo_group(std::chrono::milliseconds timeout) {
  const auto env = cohort::launch_env::detect();
  cohort::gloo::options opts;
  opts.timeout = timeout;
  return cohort::process_group<cohort::gloo>(cohort::connect_store(env), env, opts);
}

// Rank 0 serves the job's store (connect_store), from which the others read the failure
// reports that name the culprit: it stays until each survivor has named it, as run_ranks
// keeps rank 0 serving. Without this, a loaded machine let rank 0 exit first and rank 1
// reported the store unreachable instead of the culprit.
void serve_until_named(cohort::process_group<cohort::gloo>& pg, std::initializer_list<int> survivors) {
  auto& store = *pg.group_store();
  if (pg.rank() != 0) {
    store.set("test/named/" + std::to_string(pg.rank()), std::string_view("1"));
    return;
  }
  std::vector<std::string> keys;
  for (const int r : survivors)
    if (r != 0) keys.push_back("test/named/" + std::to_string(r));
  store.wait(keys, std::chrono::seconds(20));
}

// A rank that stops (SIGSTOP) and, continued by run_children once the others have ended, exits 7.
[[noreturn]] void stop_then_exit() {
  ::raise(SIGSTOP);
  ::_exit(7);
}

}  // namespace

TEST_CASE("torchrun-style environments rendezvous through the TCP store", "[multiprocess]") {
  const auto envs = torchrun_envs(3, 3, std::to_string(free_port()));
  REQUIRE(run_children(envs, sum_of_ranks) == std::vector<int>(3, 0));
}

TEST_CASE("Open MPI, MPICH and Slurm environments run the same collectives", "[multiprocess]") {
  SECTION("Open MPI") {
    const std::string port = std::to_string(free_port());
    std::vector<environment> envs;
    for (int r = 0; r < 2; ++r)
      envs.push_back({{"OMPI_COMM_WORLD_RANK", std::to_string(r)},
                      {"OMPI_COMM_WORLD_SIZE", "2"},
                      {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(r)},
                      {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                      {"MASTER_PORT", port}});
    REQUIRE(run_children(envs, sum_of_ranks) == std::vector<int>(2, 0));
  }
  SECTION("MPICH / Hydra") {
    const std::string port = std::to_string(free_port());
    std::vector<environment> envs;
    for (int r = 0; r < 2; ++r)
      envs.push_back({{"PMI_RANK", std::to_string(r)},
                      {"PMI_SIZE", "2"},
                      {"MPI_LOCALRANKID", std::to_string(r)},
                      {"MPI_LOCALNRANKS", "2"},
                      {"MASTER_PORT", port}});
    REQUIRE(run_children(envs, sum_of_ranks) == std::vector<int>(2, 0));
  }
  SECTION("Slurm, master from the node list") {
    const std::string port = std::to_string(free_port());
    std::vector<environment> envs;
    for (int r = 0; r < 2; ++r)
      envs.push_back({{"SLURM_PROCID", std::to_string(r)},
                      {"SLURM_NTASKS", "2"},
                      {"SLURM_LOCALID", std::to_string(r)},
                      {"SLURM_NTASKS_PER_NODE", "2"},
                      {"SLURM_JOB_NODELIST", "localhost"},
                      {"MASTER_PORT", port}});
    REQUIRE(run_children(envs, sum_of_ranks) == std::vector<int>(2, 0));
  }
}

TEST_CASE("a rank process that dies is an error on the others within the timeout", "[multiprocess][faults]") {
  auto envs = torchrun_envs(3, 3, std::to_string(free_port()));
  const std::string traces = fresh_trace_dir("dead");
  for (auto& env : envs) env["COHORT_TRACE_DIR"] = traces;
  const auto started = std::chrono::steady_clock::now();
  const auto codes = run_children(envs, [] {
    auto pg = launched_gloo_group(std::chrono::seconds(2));
    // The ranks share this host: their all-reduces go through shared memory, unless the run
    // asks for TCP (test_multiprocess_tcp runs this case again with COHORT_GLOO_SHARED_MEMORY=0).
    const char* transport = std::getenv("COHORT_GLOO_SHARED_MEMORY");
    if (pg.backend().uses_shared_memory() != !(transport != nullptr && std::string_view(transport) == "0")) return 5;
    std::vector<float> data(1 << 16, 1.0f);
    pg.all_reduce(std::span<float>(data)).wait();
    if (pg.rank() == 2) ::_exit(42);  // dies without a word, mid-training
    try {
      for (int step = 0; step < 100; ++step) pg.all_reduce(std::span<float>(data)).wait();
    } catch (const cohort::error& failure) {
      std::fprintf(stderr, "rank %d saw: %s\n", pg.rank(), failure.what());
      // The error is this rank's, and it names the rank that died.
      const bool names_culprit =
          std::string_view(failure.what()).find("rank 2 died or exited during all_reduce #") != std::string_view::npos;
      serve_until_named(pg, {0, 1});
      return failure.rank() == pg.rank() && names_culprit ? 0 : 3;
    }
    return 1;  // training went on without rank 2: impossible
  });
  REQUIRE(codes == std::vector<int>{0, 0, 42});
  REQUIRE(std::chrono::steady_clock::now() - started < std::chrono::seconds(30));
  require_traces_blame(traces, {2});  // the survivors' traces name the same rank
}

// A launcher that waits for its children in order (rank 0 first) leaves a rank that died
// a zombie, which the process table still lists: the survivors, waiting for it in shared
// memory, must still see it gone and name it within seconds, not at their 20 s timeout.
TEST_CASE("a rank that died and was not reaped yet is named within seconds", "[multiprocess][faults]") {
  const auto envs = torchrun_envs(3, 3, std::to_string(free_port()));
  const auto codes = run_children(
      envs,
      [] {
        auto pg = launched_gloo_group(std::chrono::seconds(20));
        const char* transport = std::getenv("COHORT_GLOO_SHARED_MEMORY");
        if (pg.backend().uses_shared_memory() != !(transport != nullptr && std::string_view(transport) == "0"))
          return 5;
        std::vector<float> data(1 << 10, 1.0f);
        pg.all_reduce(std::span<float>(data)).wait();
        if (pg.rank() == 1) ::_exit(42);  // dies without a word; its launcher reaps it last
        const auto started = std::chrono::steady_clock::now();
        try {
          for (int step = 0; step < 100; ++step) pg.all_reduce(std::span<float>(data)).wait();
        } catch (const cohort::error& failure) {
          const auto took = std::chrono::steady_clock::now() - started;
          std::fprintf(stderr, "rank %d saw after %.2f s: %s\n", pg.rank(), std::chrono::duration<double>(took).count(),
                       failure.what());
          const bool names_culprit =
              std::string_view(failure.what()).find("rank 1 died or exited during all_reduce #") !=
              std::string_view::npos;
          serve_until_named(pg, {0, 2});
          return names_culprit && took < std::chrono::seconds(8) ? 0 : 3;
        }
        return 1;  // training went on without rank 1: impossible
      },
      std::chrono::seconds(60), /*in_order=*/true);
  REQUIRE(codes == std::vector<int>{0, 42, 0});
}

// Both ranks of a "node" (ranks 2 and 3 of 4, two per node on loopback) die at once while
// rank 0 is still computing: rank 1 fails first and must name exactly the dead ranks as
// dead. Before peers were probed, a rank that sent no failure report within the window was
// named dead whenever a connection had closed: "ranks 0, 2, 3 died or exited" with rank 0
// alive and about to issue the call.
TEST_CASE("both ranks of a node killed: the ranks named dead are exactly the dead ones", "[multiprocess][faults]") {
  auto envs = torchrun_envs(4, 4, std::to_string(free_port()));
  for (int r = 0; r < 4; ++r) {
    envs[static_cast<std::size_t>(r)]["LOCAL_RANK"] = std::to_string(r % 2);
    envs[static_cast<std::size_t>(r)]["LOCAL_WORLD_SIZE"] = "2";
  }
  const auto codes = run_children(envs, [] {
    auto pg = launched_gloo_group(std::chrono::seconds(3));
    std::vector<float> data(1 << 12, 1.0f);
    pg.all_reduce(std::span<float>(data)).wait();
    if (pg.rank() >= 2) ::_exit(42);                                           // the node goes down
    if (pg.rank() == 0) std::this_thread::sleep_for(std::chrono::seconds(4));  // still computing
    try {
      pg.all_reduce(std::span<float>(data)).wait();
    } catch (const cohort::error& failure) {
      std::fprintf(stderr, "rank %d saw: %s\n", pg.rank(), failure.what());
      const std::string_view text = failure.what();
      const bool dead_named = text.find("ranks 2, 3 died or exited during all_reduce #2") != std::string_view::npos;
      const bool nobody_else = text.find("ranks 0, 2, 3 died") == std::string_view::npos &&
                               text.find("ranks 1, 2, 3 died") == std::string_view::npos &&
                               text.find("rank 0 died") == std::string_view::npos &&
                               text.find("rank 1 died") == std::string_view::npos;
      return dead_named && nobody_else ? 0 : 3;
    }
    return 1;
  });
  REQUIRE(codes == std::vector<int>{0, 0, 42, 42});
}

// Point to point, the rank at fault is the peer: rank 1 leaves without a word, and rank 0's
// send to it must name rank 1, not only "this rank is in send #1".
TEST_CASE("a send to a rank that has exited names that rank", "[multiprocess][faults]") {
  const auto envs = torchrun_envs(2, 2, std::to_string(free_port()));
  const auto codes = run_children(envs, [] {
    auto pg = launched_gloo_group(std::chrono::seconds(5));
    pg.barrier().wait();
    if (pg.rank() == 1) ::_exit(42);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // its sockets are closed by now
    std::vector<float> data(std::size_t{1} << 20, 1.0f);
    try {
      for (int step = 0; step < 20; ++step) pg.send(std::span<const float>(data), 1).wait();
    } catch (const cohort::error& failure) {
      std::fprintf(stderr, "rank 0 saw: %s\n", failure.what());
      const bool names_peer =
          std::string_view(failure.what()).find("rank 1 (the peer) closed its connection") != std::string_view::npos;
      return names_peer ? 0 : 3;
    }
    return 1;  // 80 MiB sent to nobody without an error
  });
  REQUIRE(codes == std::vector<int>{0, 42});
}

// Writing to the socket of a rank that has gone raises SIGPIPE, whose default action kills
// the writer (exit status 141) before it can say which rank died; under a C++ launcher
// nothing ignores it (Python does, so PyTorch never meets this). The threads that write to
// Gloo's sockets run with it blocked, so such a write fails with EPIPE and Gloo reports it,
// while the trainer's own threads keep their signal mask. Checked on the group's worker
// thread (the work is polled, never waited for: a waiting thread runs queued work itself)
// with a socket whose reader is gone, which is what a dead rank's socket is; and the
// caller's mask after it ran collectives itself.
TEST_CASE("a Gloo group's threads see EPIPE where a dead peer's socket would raise SIGPIPE", "[multiprocess][faults]") {
  const auto envs = torchrun_envs(2, 2, std::to_string(free_port()));
  const auto codes = run_children(envs, [] {
    auto pg = launched_gloo_group(std::chrono::seconds(5));
    std::vector<float> data(1024, 1.0f);
    for (int step = 0; step < 3; ++step) pg.all_reduce(std::span<float>(data)).wait();
    sigset_t mine;
    pthread_sigmask(SIG_BLOCK, nullptr, &mine);
    if (sigismember(&mine, SIGPIPE)) return 4;  // the group left its block on the caller
    ssize_t written = 0;
    int failure = 0;
    auto on_worker = pg.backend().enqueue([&] {
      int ends[2];
      if (::socketpair(AF_UNIX, SOCK_STREAM, 0, ends) != 0) return;
      ::close(ends[1]);
      written = ::write(ends[0], "x", 1);  // SIGPIPE here would end the process
      failure = errno;
      ::close(ends[0]);
    });
    while (!on_worker.test()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    pg.barrier().wait();
    return written == -1 && failure == EPIPE ? 0 : 3;
  });
  REQUIRE(codes == std::vector<int>{0, 0});
}

namespace {

// A launched job through run_ranks, as the examples run it: rank `dying` exits mid-training
// without a word; -1 for none. Exit codes: 0 for the error a survivor expects, 1 when
// training went on, 99 for an unexpected exception.
int launched_job(int dying) {
  int code = 1;
  try {
    cohort::run_ranks(0, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
      cohort::gloo::options opts;
      opts.timeout = std::chrono::seconds(2);  // the store keeps its default, minutes
      cohort::process_group<cohort::gloo> pg{store, env, opts};
      std::vector<float> data(1 << 12, 1.0f);
      pg.all_reduce(std::span<float>(data)).wait();
      if (pg.rank() == dying) ::_exit(42);
      for (int step = 0; step < 100; ++step) pg.all_reduce(std::span<float>(data)).wait();
    });
  } catch (const cohort::error& failure) {
    std::fprintf(stderr, "rank saw: %s\n", failure.what());
    code = 0;
  }
  return code;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

TEST_CASE("run_ranks under a launcher: rank 0 stops serving soon after a peer dies", "[multiprocess][faults]") {
  const auto started = std::chrono::steady_clock::now();
  const auto codes = run_children(torchrun_envs(3, 3, std::to_string(free_port())), [] { return launched_job(2); });
  const double took = seconds_since(started);
  INFO("took " << took << " s; the group timeout is 2 s, the failure grace " << cohort::run_ranks_failure_grace.count()
               << " s, the store timeout " << cohort::store::default_timeout.count() / 1000 << " s");
  REQUIRE(codes == std::vector<int>{0, 0, 42});
  REQUIRE(took < 2.0 + cohort::run_ranks_failure_grace.count() + 10.0);
}

TEST_CASE("run_ranks under a launcher: a peer that never arrives ends every rank within the timeouts",
          "[multiprocess][faults]") {
  const auto started = std::chrono::steady_clock::now();
  // World of 3, but only ranks 0 and 1 are started.
  const auto codes = run_children(torchrun_envs(2, 3, std::to_string(free_port())), [] { return launched_job(-1); });
  const double took = seconds_since(started);
  INFO("took " << took << " s");
  REQUIRE(codes == std::vector<int>{0, 0});
  REQUIRE(took < 2.0 + cohort::run_ranks_failure_grace.count() + 10.0);
}

namespace {

// A launched job whose rank 0 goes on alone after the last collective (saves, evaluates,
// uploads) for twice the store's timeout (2 s here, 300 s by default), then ends with
// `rank0_exit` (-1: returns normally). Exit codes: 0 when run_ranks returned, 3 when it threw
// an error that names rank 0's end (`expected`), 1 for any other error.
int rank0_works_alone(int rank0_exit, std::string_view expected) {
  try {
    cohort::run_ranks(0, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
      store->set_timeout(std::chrono::seconds(2));
      cohort::gloo::options opts;
      opts.timeout = std::chrono::seconds(2);
      cohort::process_group<cohort::gloo> pg{store, env, opts};
      std::vector<float> data(256, 1.0f);
      pg.all_reduce(std::span<float>(data)).wait();
      if (env.rank != 0) return;
      std::this_thread::sleep_for(std::chrono::seconds(4));
      if (rank0_exit >= 0) ::_exit(rank0_exit);
    });
  } catch (const cohort::error& failure) {
    std::fprintf(stderr, "rank saw: %s\n", failure.what());
    return !expected.empty() && std::string_view(failure.what()).find(expected) != std::string_view::npos ? 3 : 1;
  }
  return 0;
}

}  // namespace

// The others wait for rank 0's verdict for as long as rank 0 lives (its store answers), not
// the store's timeout: a healthy job whose rank 0 works alone longer ends 0 on every rank.
TEST_CASE("run_ranks under a launcher: rank 0 working alone past the store's timeout ends every rank well",
          "[multiprocess][faults]") {
  const auto started = std::chrono::steady_clock::now();
  const auto codes =
      run_children(torchrun_envs(3, 3, std::to_string(free_port())), [] { return rank0_works_alone(-1, {}); });
  INFO("took " << seconds_since(started) << " s; rank 0 works 4 s alone, the store's timeout is 2 s");
  REQUIRE(codes == std::vector<int>{0, 0, 0});
}

// ... and a rank 0 that dies while working alone is still named by each of them.
TEST_CASE("run_ranks under a launcher: rank 0 dying while it works alone is named by the others",
          "[multiprocess][faults]") {
  const auto started = std::chrono::steady_clock::now();
  const auto codes = run_children(torchrun_envs(3, 3, std::to_string(free_port())), [] {
    return rank0_works_alone(42, "rank 0 ended without saying how the run ended");
  });
  const double took = seconds_since(started);
  INFO("took " << took << " s; rank 0 works 4 s alone, then exits 42");
  REQUIRE(codes == std::vector<int>{42, 3, 3});
  CHECK(took < 4.0 + 10.0);
}

// A collective one rank issues alone (rank 0 gathering to sample at ZeRO-3 while the others
// are in a barrier), launched: every rank's process fails within seconds, not the group's
// timeout, and its error names rank 0's call with its context.
TEST_CASE("run_ranks under a launcher: a collective one rank issues alone fails every rank within seconds",
          "[multiprocess][faults]") {
  const auto started = std::chrono::steady_clock::now();
  const auto codes = run_children(torchrun_envs(3, 3, std::to_string(free_port())), [] {
    try {
      cohort::run_ranks(0, [](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
        cohort::gloo::options opts;
        opts.timeout = std::chrono::seconds(60);
        cohort::process_group<cohort::gloo> pg{store, env, opts};
        std::vector<float> mine(4, 1.0f), all(12);
        pg.all_reduce(mine).wait();
        if (pg.rank() == 0) {
          auto scope = pg.call_context("sample");
          pg.all_gather(mine, all).wait();
        } else {
          pg.barrier().wait();
        }
      });
    } catch (const cohort::error& failure) {
      std::fprintf(stderr, "rank saw: %s\n", failure.what());
      return std::string_view(failure.what()).find("rank 0 is in all_gather #2 (float x 4) [sample]") !=
                     std::string_view::npos
                 ? 0
                 : 3;
    }
    return 1;
  });
  const double took = seconds_since(started);
  INFO("took " << took << " s; the group timeout is 60 s");
  REQUIRE(codes == std::vector<int>{0, 0, 0});
  REQUIRE(took < 15.0);
}

TEST_CASE("under torchrun the failing rank's error reaches the agent's error file", "[multiprocess][faults]") {
  char pattern[] = "/tmp/cohort-errorfile-XXXXXX";
  REQUIRE(::mkdtemp(pattern) != nullptr);
  const std::string directory = pattern;
  auto envs = torchrun_envs(2, 2, std::to_string(free_port()));
  for (int r = 0; r < 2; ++r) envs[r]["TORCHELASTIC_ERROR_FILE"] = directory + "/error" + std::to_string(r) + ".json";
  const auto codes = run_children(envs, [] {
    try {
      cohort::run_ranks(0, [](std::shared_ptr<cohort::store>, const cohort::launch_env& env) {
        if (env.rank == 1) throw cohort::error(1, "load_checkpoint", "no file \"step_100.bin\"\nin ./ckpt", "resume");
      });
    } catch (const cohort::error&) {
      return 0;
    }
    return 1;
  });
  // Rank 1 failed, and rank 0, which finished its part, learns it at the end: no rank of a
  // failed run ends as if it had succeeded (both catch a cohort::error).
  REQUIRE(codes == std::vector<int>{0, 0});
  const auto read = [](const std::string& path) {
    std::string text;
    if (std::FILE* file = std::fopen(path.c_str(), "r")) {
      char buffer[4096];
      for (std::size_t n; (n = std::fread(buffer, 1, sizeof buffer, file)) > 0;) text.append(buffer, n);
      std::fclose(file);
    }
    return text;
  };
  CHECK(read(directory + "/error0.json").empty());  // the root cause is rank 1's alone
  const std::string written = read(directory + "/error1.json");
  INFO(written);
  const std::string message =
      "cohort::error: cohort [rank 1] load_checkpoint: no file \\\"step_100.bin\\\"\\nin ./ckpt (hint: resume)";
  REQUIRE_THAT(written, Catch::StartsWith("{\"message\": {\"message\": \"" + message + "\", \"extraInfo\": {"));
  // Any JSON parser reads it back to the original text (Python's, the one torchrun uses).
  if (std::system("python3 -c pass >/dev/null 2>&1") == 0) {
    const std::string check =
        "python3 -c \"import json,sys; d=json.load(open(sys.argv[1])); m=d['message']; "
        "assert m['message'].endswith('in ./ckpt (hint: resume)'), m; int(m['extraInfo']['timestamp'])\" " +
        directory + "/error1.json";
    CHECK(std::system(check.c_str()) == 0);
  }
  std::remove((directory + "/error1.json").c_str());
  ::rmdir(directory.c_str());
}

TEST_CASE("a stopped rank (SIGSTOP) is named by the others within the timeout", "[multiprocess][faults]") {
  // A stopped process keeps its sockets open: nothing resets, the others only wait. They
  // must still end within the timeout and report window, naming the stopped rank as this
  // host's process table shows it (it was "unknown": computing, stopped, or blocked), not
  // accused of a call it may be about to issue (the traces, written by the others, still show
  // it never issued it).
  auto envs = torchrun_envs(3, 3, std::to_string(free_port()));
  const std::string traces = fresh_trace_dir("stopped");
  for (auto& env : envs) env["COHORT_TRACE_DIR"] = traces;
  const auto started = std::chrono::steady_clock::now();
  const auto codes = run_children(envs, [] {
    auto pg = launched_gloo_group(std::chrono::seconds(2));
    std::vector<float> data(1 << 12, 1.0f);
    pg.all_reduce(std::span<float>(data)).wait();
    if (pg.rank() == 2) stop_then_exit();
    const auto issued = std::chrono::steady_clock::now();
    try {
      pg.all_reduce(std::span<float>(data)).wait();
    } catch (const cohort::timeout_error& failure) {
      std::fprintf(stderr, "rank %d saw: %s\n", pg.rank(), failure.what());
      // The timeout (2 s) and the report window (2 s), with room for a loaded machine.
      if (std::chrono::steady_clock::now() - issued > std::chrono::seconds(7)) return 4;
      const bool names_culprit = std::string_view(failure.what())
                                     .find(
                                         "rank 2 is stopped during all_reduce #2 (float x 4096, sum) (its "
                                         "process is stopped") != std::string_view::npos;
      serve_until_named(pg, {0, 1});
      return names_culprit ? 0 : 3;
    }
    return 1;
  });
  REQUIRE(codes == std::vector<int>{0, 0, 7});
  REQUIRE(std::chrono::steady_clock::now() - started < std::chrono::seconds(30));
  require_traces_blame(traces, {2});
}

// Rank 0's store stopped (SIGSTOP): rank 1 times out first and closes its connections, then
// tries the store for the report window. Rank 2, entering later, saw rank 1's connection close
// and said "rank 1 died or exited (its connection closed)" while rank 1's process ran. Now what
// is known is said: rank 1 closed its connection and its process runs; rank 0 is stopped.
TEST_CASE("a store that cannot be reached: a closed connection of a running rank is not a death",
          "[multiprocess][faults]") {
  auto envs = torchrun_envs(3, 3, std::to_string(free_port()));
  for (auto& env : envs) env["COHORT_GLOO_SHARED_MEMORY"] = "0";  // over TCP pairs, which close
  const auto codes = run_children(envs, [] {
    auto pg = launched_gloo_group(std::chrono::seconds(2));
    std::vector<float> data(1 << 12, 1.0f);
    pg.all_reduce(std::span<float>(data)).wait();
    if (pg.rank() == 0) stop_then_exit();
    // Rank 2 comes once rank 1 has timed out (2 s) and closed its pairs, while it still tries
    // the store.
    if (pg.rank() == 2) std::this_thread::sleep_for(std::chrono::milliseconds(2800));
    const auto entered = std::chrono::steady_clock::now();
    try {
      pg.all_reduce(std::span<float>(data)).wait();
    } catch (const cohort::error& failure) {
      std::fprintf(stderr, "rank %d saw after %.1f s: %s\n", pg.rank(), seconds_since(entered), failure.what());
      const std::string_view text = failure.what();
      const bool zero_stopped = text.find(
                                    "rank 0 is stopped during all_reduce #2 (float x 4096, sum) (its process is "
                                    "stopped") != text.npos;
      if (pg.rank() == 1) return zero_stopped ? 0 : 3;
      const bool one_closed = text.find("rank 1 closed its connection during all_reduce #2") != text.npos &&
                              text.find("its connection closed, but its process runs") != text.npos &&
                              text.find("died") == text.npos;
      return zero_stopped && one_closed ? 0 : 3;
    }
    return 1;
  });
  REQUIRE(codes == std::vector<int>{7, 0, 0});
}

namespace {

// Leaves this process no file descriptor to open while it lives (a rank that has run out of
// them: its pairs, its shared memory): the limit at the lowest number not in use, so the
// descriptors it holds keep working.
class descriptors_exhausted {
 public:
  descriptors_exhausted() {
    ::getrlimit(RLIMIT_NOFILE, &before_);
    int lowest_free = 0;
    while (::fcntl(lowest_free, F_GETFD) != -1 || errno != EBADF) ++lowest_free;
    rlimit now = before_;
    now.rlim_cur = static_cast<rlim_t>(lowest_free);
    ::setrlimit(RLIMIT_NOFILE, &now);
  }
  descriptors_exhausted(const descriptors_exhausted&) = delete;
  descriptors_exhausted& operator=(const descriptors_exhausted&) = delete;
  ~descriptors_exhausted() { ::setrlimit(RLIMIT_NOFILE, &before_); }

 private:
  rlimit before_{};
};

// A child's stderr goes to the file TEST_LOG names, for the test to read every line it printed.
void redirect_stderr_to_test_log() {
  const int log = ::open(std::getenv("TEST_LOG"), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  ::dup2(log, STDERR_FILENO);
  ::close(log);
}

// What a child wrote to stderr, line by line (redirect_stderr_to_test_log).
std::vector<std::string> lines_of(const std::string& path) {
  std::vector<std::string> lines;
  std::ifstream file(path);
  for (std::string line; std::getline(file, line);) lines.push_back(line);
  return lines;
}

// The hybrid cases' four children as two nodes of two ranks, each child's stderr in
// LOGS/rank<R>.log (redirect_stderr_to_test_log), progress lines every second.
void on_two_nodes_logged(std::vector<environment>& envs, const std::string& logs) {
  for (std::size_t r = 0; r < envs.size(); ++r) {
    auto& env = envs[r];
    env["LOCAL_RANK"] = std::to_string(r % 2);
    env["LOCAL_WORLD_SIZE"] = "2";
    env["COHORT_PROGRESS_INTERVAL"] = "1";  // the progress lines within the 3 s timeouts
    env["TEST_LOG"] = logs + "/rank" + std::to_string(r) + ".log";
  }
}

// Every line each of WORLD children printed, each also shown if the case fails.
std::vector<std::vector<std::string>> lines_printed(const std::string& logs, int world) {
  std::vector<std::vector<std::string>> printed;
  for (int r = 0; r < world; ++r) printed.push_back(lines_of(logs + "/rank" + std::to_string(r) + ".log"));
  for (int r = 0; r < world; ++r)
    for (const auto& line : printed[static_cast<std::size_t>(r)]) UNSCOPED_INFO("rank " << r << ": " << line);
  return printed;
}

// The ranks a subgroup's message names by a bare number ("rank 1", "ranks 0, 1"): in each
// part of `line` from "group pg1.split" to its hint, a "rank N" not preceded by "world " or
// "group ". A run_ranks line's own ranks, outside those parts, are world ranks already.
int bare_ranks_in_subgroup_messages(std::string_view line) {
  int bare = 0;
  for (auto from = line.find("group pg1.split"); from != std::string_view::npos;
       from = line.find("group pg1.split", from + 1)) {
    const std::string_view part = line.substr(from, line.find("(hint:", from) - from);
    for (auto at = part.find("rank"); at != std::string_view::npos; at = part.find("rank", at + 1)) {
      const auto number = part.find_first_not_of("s ", at + 4);
      const bool numbered = number != std::string_view::npos && number > at + 4 && std::isdigit(part[number]) != 0;
      const bool qualified = at >= 6 && (part.substr(at - 6, 6) == "world " || part.substr(at - 6, 6) == "group ");
      if (numbered && !qualified) ++bare;
    }
  }
  return bare;
}

}  // namespace

// A hybrid run (2 nodes x 2 ranks, replicas split across nodes): world rank 3 dies in its
// replicas group (world ranks 1, 3). World rank 1 said "cohort [rank 0] ... rank 1 died or
// exited", in the group's own numbers, naming neither the group nor world rank 3. Now its error
// is world rank 1's, names the group with its world ranks, and the dead rank by world rank.
TEST_CASE("run_ranks under a launcher: a subgroup's failure names the group and world ranks",
          "[multiprocess][faults]") {
  auto envs = torchrun_envs(4, 4, std::to_string(free_port()));
  const std::string logs = fresh_trace_dir("subgroup_failure");
  on_two_nodes_logged(envs, logs);
  const auto codes = run_children(envs, [] {
    redirect_stderr_to_test_log();
    try {
      cohort::run_ranks(0, [](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
        cohort::gloo::options opts;
        opts.timeout = std::chrono::seconds(3);
        cohort::process_group<cohort::gloo> pg{store, env, opts};
        auto replicas = pg.split(pg.local_rank(), pg.rank() - pg.local_rank());
        std::vector<float> data(256, 1.0f);
        replicas->all_reduce(std::span<float>(data)).wait();
        if (env.rank == 3) ::_exit(42);
        replicas->all_reduce(std::span<float>(data)).wait();
      });
    } catch (const cohort::error& failure) {
      std::fprintf(stderr, "rank saw: %s\n", failure.what());
      const std::string_view text = failure.what();
      if (text.find("finished, but the run failed") != text.npos) return 2;
      const bool named = text.starts_with("cohort [rank 1] gloo.all_reduce #2") &&
                         text.find(
                             " (world ranks 1, 3): world rank 3 (group rank 1) died or exited during "
                             "all_reduce #2") != text.npos &&
                         text.find("world rank 1 (group rank 0) is in all_reduce #2") != text.npos &&
                         // The transport's own detail too ("[rank 1's process is gone: ...]" before).
                         text.find(" [world rank 3 (group rank 1)") != text.npos;
      return named ? 0 : 3;
    }
    return 1;
  });
  const auto printed = lines_printed(logs, 4);
  REQUIRE(codes == std::vector<int>{2, 0, 2, 42});
  // Every line every rank printed (the error, run_ranks' progress lines and verdicts, which
  // quote it): the subgroup's messages name their ranks by world rank, everywhere.
  int quoted = 0;
  for (int r = 0; r < 4; ++r)
    for (const auto& line : printed[static_cast<std::size_t>(r)]) {
      INFO("rank " << r << ": " << line);
      CHECK(bare_ranks_in_subgroup_messages(line) == 0);
      if (line.find("group pg1.split0.color1 (world ranks 1, 3): world rank 3 (group rank 1) died") != line.npos)
        ++quoted;
    }
  CHECK(quoted >= 4);  // rank 1's error, and run_ranks' verdict on ranks 0, 1, 2
}

// A hybrid run (2 nodes x 2 ranks) whose world rank 3 cannot open a descriptor when the replicas
// groups are made: it never publishes its address in its group's rendezvous (world ranks 1, 3).
// World rank 1, group rank 0 there, said "rank 1 never arrived at the rendezvous": its own
// number in the world, naming neither the group nor world rank 3; its progress lines told it
// "rank 0 names them", itself. Now every line a rank prints names the group and world ranks.
TEST_CASE("run_ranks under a launcher: a subgroup member missing at its rendezvous is named by world rank",
          "[multiprocess][faults]") {
  // UBSan's vptr check (the asan tier) reads the caught exception's type through a pipe, which
  // the rank without descriptors cannot open: it reports an invalid vptr where there is none.
  if (cohort_test::sanitized)
    cohort_test::skip("the sanitizers' runtime needs descriptors of its own, which this case takes away");
  auto envs = torchrun_envs(4, 4, std::to_string(free_port()));
  const std::string logs = fresh_trace_dir("subgroup_rendezvous");
  on_two_nodes_logged(envs, logs);
  const auto codes = run_children(envs, [] {
    redirect_stderr_to_test_log();
    try {
      cohort::run_ranks(0, [](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
        cohort::gloo::options opts;
        opts.timeout = std::chrono::seconds(3);
        cohort::process_group<cohort::gloo> pg{store, env, opts};
        std::optional<descriptors_exhausted> exhausted;
        if (env.rank == 3) exhausted.emplace();
        auto replicas = pg.split(pg.local_rank(), pg.rank() - pg.local_rank());
        exhausted.reset();
        std::vector<float> data(256, 1.0f);
        replicas->all_reduce(std::span<float>(data)).wait();
      });
    } catch (const cohort::error& failure) {
      std::fprintf(stderr, "rank saw: %s\n", failure.what());
      return 5;
    }
    return 0;
  });
  const auto printed = lines_printed(logs, 4);
  CHECK(codes == std::vector<int>{5, 5, 5, 5});
  // World rank 1 waited in group pg1.split0.color1, whose group rank 1 is world rank 3.
  bool named = false;
  int progress = 0;
  for (const auto& line : printed[1]) {
    if (line.find("rendezvous") == std::string::npos) continue;
    CHECK(line.find("pg1.split0.color1") != std::string::npos);
    CHECK(line.find("rank 1 never") == std::string::npos);
    CHECK(line.find("(rank 0 ") == std::string::npos);
    if (line.find("rendezvous: waiting") != std::string::npos) {
      ++progress;
      CHECK(line.find("world rank 3 (group rank 1) never arrived at the rendezvous") != std::string::npos);
    }
    if (line.find("gloo.rendezvous: group pg1.split0.color1 (world ranks 1, 3): world rank 3 (group rank 1) "
                  "never arrived at the rendezvous") != std::string::npos)
      named = true;
  }
  CHECK(named);
  CHECK(progress >= 1);
  // World rank 3 says why it never arrived, naming its peer the same way.
  bool said_why = false;
  for (const auto& line : printed[3])
    said_why = said_why || line.find(
                               "cohort [rank 3] gloo.rendezvous: group pg1.split0.color1 (world ranks 1, 3): "
                               "cannot open this rank's end of its connection with world rank 1 (group rank "
                               "0)") != std::string::npos;
  CHECK(said_why);
  // Every line of every rank that names a group's rank names it by world rank.
  for (int r = 0; r < 4; ++r)
    for (const auto& line : printed[static_cast<std::size_t>(r)]) {
      INFO("rank " << r << ": " << line);
      CHECK(bare_ranks_in_subgroup_messages(line) == 0);
    }
}

// Rank 0 publishes its verdict and serves until the ranks that reported have read it; one that
// reported and then vanished (killed, or cut off) never reads it, and rank 0 waited the store's
// whole timeout (300 s by default) without a line. Now a request's bound, then a line.
TEST_CASE("run_ranks under a launcher: rank 0 does not wait for a verdict's reader that is gone",
          "[multiprocess][faults]") {
  cohort::memory_store store;
  store.set_timeout(std::chrono::seconds(30));
  store.set("cohort/run_ranks/outcome/1", std::string_view("ok"));  // rank 1 reported, then vanished
  store.add("cohort/run_ranks/reported", 1);
  cohort::launch_env env;
  env.rank = 0;
  env.world_size = 2;
  const auto started = std::chrono::steady_clock::now();
  cohort::detail::finish_launched_rank(store, env, nullptr);
  const double took = seconds_since(started);
  INFO("took " << took << " s; the store's timeout is 30 s, a request's bound " << cohort::run_ranks_exit_bound.count()
               << " s");
  REQUIRE(took < cohort::run_ranks_exit_bound.count() + 3.0);
}

// Rank 3 never reports (it died) and rank 1 reported its failure: rank 0 waits the grace for
// rank 3, then publishes its verdict, and left at once, the grace being over, without waiting
// for the ranks that reported to read it: a reader a moment slow (a loaded machine) found the
// store closed ("cannot reach rank 0's store ... to learn how the run ended") instead of the
// verdict. Now the readers have a request's bound to read it, whatever the grace.
TEST_CASE("run_ranks under a launcher: rank 0 waits for the verdict's readers after the grace is over",
          "[multiprocess][faults]") {
  cohort::memory_store store;
  store.set_timeout(std::chrono::seconds(2));  // the grace and a request's bound: 2 s
  store.set("cohort/run_ranks/outcome/1", std::string_view("failed\nrank 1's error"));
  store.add("cohort/run_ranks/failed", 1);
  store.add("cohort/run_ranks/reported", 1);
  store.set("cohort/run_ranks/outcome/2", std::string_view("ok"));
  store.add("cohort/run_ranks/reported", 1);
  std::thread readers([&] {  // ranks 1 and 2, 300 ms slow to acknowledge what they read
    store.get("cohort/run_ranks/verdict", std::chrono::seconds(10));
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    store.add("cohort/run_ranks/acknowledged", 2);
  });
  cohort::launch_env env;
  env.rank = 0;
  env.world_size = 4;
  std::string said;
  try {
    cohort::detail::finish_launched_rank(store, env, nullptr);
  } catch (const cohort::error& failure) {
    said = failure.what();
  }
  const auto acknowledged_when_rank0_left = store.add("cohort/run_ranks/acknowledged", 0);
  readers.join();
  CHECK_THAT(said, Catch::Contains("this rank finished, but the run failed: rank 1 failed") &&
                       Catch::Contains("rank 3 did not report the end of its run"));
  CHECK(acknowledged_when_rank0_left == 2);
}

namespace {

// A rank of a job without an id (torchrun's default) training `steps` all-reduces. A process
// with TEST_LATE set comes 1.5 s late: its rank was claimed meanwhile by a process of another
// such job, which trains with this job's other ranks. `collision_check`: how often the first
// group's watchdog reads the job's collided mark (0: never; run_ranks' verdict still does).
// Exit codes: 0 when run_ranks returned (the mixed job ended well), 5 when it threw naming the
// collision, 1 for any other error.
int rank_of_a_job_without_id(std::chrono::milliseconds collision_check, int steps) {
  if (std::getenv("TEST_LATE") != nullptr) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  try {
    cohort::run_ranks(0, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
      cohort::gloo::options opts;
      opts.timeout = std::chrono::seconds(10);
      opts.collision_check_interval = collision_check;
      opts.on_async_error = cohort::async_error_handling::throw_on_next_call;
      cohort::process_group<cohort::gloo> pg{store, env, opts};
      std::vector<float> data(256, 1.0f);
      for (int step = 0; step < steps; ++step) {
        pg.all_reduce(std::span<float>(data)).wait();
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    });
  } catch (const cohort::error& failure) {
    std::fprintf(stderr, "rank saw: %s\n", failure.what());
    return std::string_view(failure.what()).find("job collision") != std::string_view::npos ? 5 : 1;
  }
  return 0;
}

// Ranks 0 and 1 of a job without an id and rank 2 of another (started with them) form one
// group and pass its start's collision check; the first job's own rank 2 comes 1.5 s later,
// is the second claimant of rank 2, fails and marks the job collided. That mixed job ended
// in success on every rank. Now no rank of it ends well, and each names the collision.
std::vector<environment> mixed_job_envs() {
  auto envs = torchrun_envs(3, 3, std::to_string(free_port()));
  envs.push_back(envs[2]);
  envs[3]["TEST_LATE"] = "1";
  return envs;
}

}  // namespace

TEST_CASE("run_ranks under a launcher: a job joined by another job's rank fails every rank at its end",
          "[multiprocess][faults][collision]") {
  // 3 s of training; the mark is set at about 1.5 s; no watchdog check: run_ranks' verdict.
  const auto codes =
      run_children(mixed_job_envs(), [] { return rank_of_a_job_without_id(std::chrono::milliseconds(0), 30); });
  REQUIRE(codes == std::vector<int>{5, 5, 5, 5});
}

TEST_CASE("run_ranks under a launcher: a job joined by another job's rank stops soon after the late claim",
          "[multiprocess][faults][collision]") {
  // 30 s of training; the mark is set at about 1.5 s and read every 500 ms by the watchdog.
  const auto started = std::chrono::steady_clock::now();
  const auto codes =
      run_children(mixed_job_envs(), [] { return rank_of_a_job_without_id(std::chrono::milliseconds(500), 300); });
  const double took = seconds_since(started);
  INFO("took " << took << " s; the job trains 30 s if nothing stops it");
  REQUIRE(codes == std::vector<int>{5, 5, 5, 5});
  CHECK(took < 10.0);
}
