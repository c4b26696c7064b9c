// bench_rendezvous: what a start costs rank 0's store, as the world grows. N simulated ranks
// (threads of this process, each with its own TCP connection, as real ranks have) run the key
// pattern of a real start against one TCPStore server on loopback:
//   connect            VALIDATE + PING (connect_store ends the handshake with the job record's
//                      COMPARE_SET instead, then claims its rank: one request more)
//   process group      ADD cohort/groups_created/<rank> (the group's prefix; a rank's first
//                      group also CHECKs the job's collision mark, not part of the pattern)
//   NCCL device check  SET device/<rank> "host|bus id", then read every rank's (select_device)
//   NCCL unique id     rank 0 SETs nccl_unique_id (128 bytes), the others GET it
//   split              SET split0/<rank> "color,key,node", then read every rank's (split)
// "Every rank's" is read the way cohort reads it now (batched: one WAIT + one MULTI_GET) and,
// for comparison, the way it did before (per key: WAIT + GET for each of N keys). It reports
// the requests each rank sent (counted by the client) and the wall time from the moment all
// ranks start until the last is done. The server is cohort's (tcp_store_server, in a child
// process) and, side by side, PyTorch's TCPStore (libuv backend) when a PyTorch 2.x is
// importable by --python (bench/peers/torch_store_server.py); the clients are cohort's on both.
// Gloo's mesh (cohort connects it: one SET, one WAIT, one MULTI_GET per rank, whatever N;
// tests/test_rendezvous.cpp counts a real group and split) and NCCL's bootstrap (which does
// not go through code cohort controls) are not part of the pattern.
//
//   bench_rendezvous [--ranks 64,256,512,1024] [--repeat 3] [--per-key-max 512] [--python python3]
//                    [--torch-peer bench/peers/torch_store_server.py] [--torch libuv,classic | --no-torch]
//                    [--json FILE]
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cohort/comm/detail/device_identity.hpp>
#include <cohort/rendezvous/store.hpp>
#include <cohort/rendezvous/tcp_store.hpp>
#include <cohort/rendezvous/tcp_store_server.hpp>
#include <cohort/tools/detail/json.hpp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <latch>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

struct config {
  std::vector<int> ranks{64, 256, 512, 1024};
  int repeat = 3;
  int per_key_max = 512;
  std::string python = "python3";
  std::string torch_peer = std::string(COHORT_BENCH_SOURCE_DIR) + "/peers/torch_store_server.py";
  std::vector<std::string> torch_backends{"libuv"};
  std::string json_path;
};

enum class reads { batched, per_key };
const char* name_of(reads how) { return how == reads::batched ? "batched" : "per-key"; }

// A TCPStore server in another process: cohort's (forked) or PyTorch's (python), stopped by
// closing its standard input.
class server_process {
 public:
  static std::optional<server_process> cohort_server(std::size_t reserved) {
    int port_pipe[2];
    int stop_pipe[2];
    if (::pipe(port_pipe) != 0 || ::pipe(stop_pipe) != 0) return std::nullopt;
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(port_pipe[0]);
      ::close(stop_pipe[1]);
      int code = 0;
      try {
        cohort::tcp_store_server_options options;
        options.reserved_connections = reserved;
        cohort::tcp_store_server server("127.0.0.1", 0, 0, options);
        const std::string line = "PORT " + std::to_string(server.port()) + "\n";
        if (::write(port_pipe[1], line.data(), line.size()) < 0) code = 1;
        char sink;
        while (::read(stop_pipe[0], &sink, 1) > 0) {}
      } catch (const std::exception& failure) {
        std::fprintf(stderr, "cohort server: %s\n", failure.what());
        code = 1;
      }
      std::fflush(nullptr);
      ::_exit(code);
    }
    ::close(port_pipe[1]);
    ::close(stop_pipe[0]);
    return finish_start(pid, port_pipe[0], stop_pipe[1], "cohort tcp_store_server");
  }

  static std::optional<server_process> torch_server(const std::string& python, const std::string& script,
                                                    const std::string& backend, std::string& why_not) {
    int out_pipe[2];
    int in_pipe[2];
    if (::pipe(out_pipe) != 0 || ::pipe(in_pipe) != 0) return std::nullopt;
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::dup2(in_pipe[0], 0);
      ::dup2(out_pipe[1], 1);
      ::close(in_pipe[1]);
      ::close(out_pipe[0]);
      ::execlp(python.c_str(), python.c_str(), script.c_str(), backend.c_str(), static_cast<char*>(nullptr));
      std::printf("SKIP cannot run %s\n", python.c_str());
      std::fflush(nullptr);
      ::_exit(0);
    }
    ::close(out_pipe[1]);
    ::close(in_pipe[0]);
    auto server = finish_start(pid, out_pipe[0], in_pipe[1], "PyTorch TCPStore (" + backend + ")");
    if (!server) why_not = "no answer from " + python + " " + script;
    if (server && server->port_ == 0) {
      why_not = server->banner_;
      return std::nullopt;
    }
    return server;
  }

  server_process(server_process&& other) noexcept
      : pid_(std::exchange(other.pid_, -1)),
        input_(std::exchange(other.input_, -1)),
        output_(std::exchange(other.output_, nullptr)),
        port_(other.port_),
        name_(std::move(other.name_)),
        banner_(std::move(other.banner_)) {}
  server_process(const server_process&) = delete;
  server_process& operator=(const server_process&) = delete;
  server_process& operator=(server_process&&) = delete;
  ~server_process() {
    if (input_ >= 0) ::close(input_);
    if (output_) std::fclose(output_);
    if (pid_ > 0) {
      int status = 0;
      for (int i = 0; i < 500 && ::waitpid(pid_, &status, WNOHANG) == 0; ++i) std::this_thread::sleep_for(10ms);
      if (::waitpid(pid_, &status, WNOHANG) == 0) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status, 0);
      }
    }
  }

  std::uint16_t port() const { return port_; }
  const std::string& name() const { return name_; }
  // CPU time the server process has used (user + system), from /proc/<pid>/stat.
  double cpu_ms() const {
    std::ifstream in("/proc/" + std::to_string(pid_) + "/stat");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto after_name = text.rfind(')');
    if (after_name == std::string::npos) return 0;
    std::istringstream fields(text.substr(after_name + 2));
    std::string field;
    double ticks = 0;
    for (int index = 3; fields >> field && index <= 15; ++index)
      if (index == 14 || index == 15) ticks += std::stod(field);  // utime, stime
    return 1e3 * ticks / static_cast<double>(::sysconf(_SC_CLK_TCK));
  }
  const std::string& banner() const { return banner_; }

 private:
  server_process(pid_t pid, int input, std::FILE* output, std::string name)
      : pid_(pid), input_(input), output_(output), name_(std::move(name)) {}

  static std::optional<server_process> finish_start(pid_t pid, int output, int input, std::string name) {
    server_process server(pid, input, ::fdopen(output, "r"), std::move(name));
    char line[512] = {};
    if (!server.output_ || !std::fgets(line, sizeof line, server.output_)) return std::nullopt;
    server.banner_ = line;
    while (!server.banner_.empty() && server.banner_.back() == '\n') server.banner_.pop_back();
    unsigned port = 0;
    if (std::sscanf(line, "PORT %u", &port) == 1) server.port_ = static_cast<std::uint16_t>(port);
    return server;
  }

  pid_t pid_ = -1;
  int input_ = -1;
  std::FILE* output_ = nullptr;
  std::uint16_t port_ = 0;
  std::string name_;
  std::string banner_;
};

std::string identity_of(int rank) {
  char bus[32];
  std::snprintf(bus, sizeof bus, "0000:%02x:00.0", 0x10 + rank % 8);
  return "node" + std::to_string(rank / 8) + "|" + bus;
}

std::vector<std::string> read_all(cohort::store& group, const std::string& base, int world, reads how) {
  std::vector<std::string> keys;
  for (int r = 0; r < world; ++r) keys.push_back(base + std::to_string(r));
  std::vector<std::string> values;
  if (how == reads::batched) {
    for (const auto& value : group.multi_get(keys)) values.push_back(cohort::to_string(value));
  } else {
    for (const auto& key : keys) values.push_back(group.get_string(key));
  }
  return values;
}

// One rank's start, on its own connection; `connected` is called once the connection is up.
template <class Connected>
void start_of_rank(std::uint16_t port, const std::string& run, int rank, int world, reads how, std::uint64_t& requests,
                   Connected&& connected) {
  cohort::tcp_store_options options;
  options.port = port;
  options.rank = rank;
  options.timeout = 300s;
  options.connect_timeout = 120s;
  auto connection = std::make_shared<cohort::tcp_store>(options);
  connected();
  auto root = std::make_shared<cohort::prefix_store>(connection, run);
  const auto index = root->add("cohort/groups_created/" + std::to_string(rank), 1);
  cohort::prefix_store group(root, "cohort/pg" + std::to_string(index) + "/");
  // NCCL's device check (nccl::select_device).
  group.set("device/" + std::to_string(rank), identity_of(rank));
  const auto identities = read_all(group, "device/", world, how);
  for (int r = 0; r < world; ++r)
    if (identities[static_cast<std::size_t>(r)] != identity_of(r) ||
        !cohort::detail::well_formed_device_identity(identities[static_cast<std::size_t>(r)]))
      throw std::runtime_error("rank " + std::to_string(rank) + " read a wrong identity of rank " + std::to_string(r));
  // NCCL's unique id (the nccl backend's constructor).
  if (rank == 0) {
    group.set("nccl_unique_id", std::string(128, 'u'));
  } else if (group.get("nccl_unique_id").size() != 128) {
    throw std::runtime_error("rank " + std::to_string(rank) + " read a wrong unique id");
  }
  // One split into two halves (process_group::split).
  const int color = rank % 2;
  group.set("split0/" + std::to_string(rank),
            std::to_string(color) + "," + std::to_string(rank) + "," + std::to_string(rank / 8 * 8));
  int members = 0;
  for (const auto& entry : read_all(group, "split0/", world, how)) {
    int fields[3] = {};
    if (!cohort::detail::parse_int_fields(entry, ',', fields))
      throw std::runtime_error("rank " + std::to_string(rank) + " read a malformed split entry");
    if (fields[0] == color) ++members;
  }
  if (members != (world + 1 - color) / 2) throw std::runtime_error("wrong split size");
  requests = connection->requests_sent();
}

struct result {
  std::string server;
  reads how = reads::batched;
  int ranks = 0;
  double requests_per_rank = 0;
  std::uint64_t requests_max = 0;
  std::vector<double> wall_ms;        // all ranks released until the last is done
  std::vector<double> connect_ms;     // until the last rank is connected
  std::vector<double> server_cpu_ms;  // the server process's CPU time during the run
  std::string failure;
  static double min_of(const std::vector<double>& values) { return *std::min_element(values.begin(), values.end()); }
  static double median_of(std::vector<double> values) {
    std::sort(values.begin(), values.end());
    return values[values.size() / 2];
  }
};

// All ranks start together (a latch); the wall time runs from then until the last is done.
void run_once(std::uint16_t port, const std::string& run, int world, reads how, result& out) {
  std::vector<std::uint64_t> requests(static_cast<std::size_t>(world), 0);
  std::vector<clock_type::time_point> done(static_cast<std::size_t>(world));
  std::vector<clock_type::time_point> connected(static_cast<std::size_t>(world));
  std::mutex failure_mutex;
  std::string failure;
  std::latch go(1);
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(world));
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      go.wait();
      try {
        start_of_rank(port, run, rank, world, how, requests[static_cast<std::size_t>(rank)],
                      [&] { connected[static_cast<std::size_t>(rank)] = clock_type::now(); });
      } catch (const std::exception& error) {
        std::lock_guard lock(failure_mutex);
        if (failure.empty()) failure = error.what();
      }
      done[static_cast<std::size_t>(rank)] = clock_type::now();
    });
  }
  const auto started = clock_type::now();
  go.count_down();
  for (auto& thread : threads) thread.join();
  const auto last = *std::max_element(done.begin(), done.end());
  const auto last_connected = *std::max_element(connected.begin(), connected.end());
  out.wall_ms.push_back(std::chrono::duration<double, std::milli>(last - started).count());
  out.connect_ms.push_back(std::chrono::duration<double, std::milli>(last_connected - started).count());
  std::uint64_t total = 0;
  for (const auto count : requests) {
    total += count;
    out.requests_max = std::max(out.requests_max, count);
  }
  out.requests_per_rank = static_cast<double>(total) / world;
  if (!failure.empty() && out.failure.empty()) out.failure = failure;
}

void raise_descriptor_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  limit.rlim_cur = limit.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &limit);
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) items.push_back(item);
  return items;
}

}  // namespace

int main(int argc, char** argv) {
  config cfg;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--ranks") {
      cfg.ranks.clear();
      for (const auto& item : split_list(value())) cfg.ranks.push_back(std::stoi(item));
    } else if (arg == "--repeat") {
      cfg.repeat = std::max(1, std::stoi(value()));
    } else if (arg == "--per-key-max") {
      cfg.per_key_max = std::stoi(value());
    } else if (arg == "--python") {
      cfg.python = value();
    } else if (arg == "--torch-peer") {
      cfg.torch_peer = value();
    } else if (arg == "--torch") {
      cfg.torch_backends = split_list(value());
    } else if (arg == "--no-torch") {
      cfg.torch_backends.clear();
    } else if (arg == "--json") {
      cfg.json_path = value();
    } else {
      std::fprintf(stderr,
                   "usage: bench_rendezvous [--ranks 64,256,...] [--repeat R] [--per-key-max N] [--python PATH] "
                   "[--torch-peer FILE] [--torch libuv,classic | --no-torch] [--json FILE]\n");
      return 2;
    }
  }
  raise_descriptor_limit();
  const int largest = *std::max_element(cfg.ranks.begin(), cfg.ranks.end());

  // Servers first, while this process has no threads (they fork).
  std::vector<server_process> servers;
  if (auto server = server_process::cohort_server(static_cast<std::size_t>(largest)))
    servers.push_back(std::move(*server));
  std::vector<std::string> not_measured;
  for (const auto& backend : cfg.torch_backends) {
    std::string why;
    if (auto server = server_process::torch_server(cfg.python, cfg.torch_peer, backend, why))
      servers.push_back(std::move(*server));
    else
      not_measured.push_back("PyTorch TCPStore (" + backend + "): " + why);
  }

  std::printf(
      "# bench_rendezvous: N ranks as threads on loopback (each its own connection), the key pattern of a "
      "start: connect, process group, NCCL device check, NCCL unique id, one split\n");
  for (const auto& server : servers)
    if (server.banner().find("torch") != std::string::npos)
      std::printf("# %s: %s\n", server.name().c_str(), server.banner().c_str());
  for (const auto& line : not_measured) std::printf("# not measured: %s\n", line.c_str());
  if (servers.size() > 1)
    std::printf(
        "# PyTorch's servers look each new client's address up (reverse DNS) on their event loop: where the "
        "resolver is slow their connect times include it (docs/benchmarks.md)\n");
  std::printf("# %-26s %-8s %6s %9s %5s %12s %12s %12s %11s\n", "server", "reads", "ranks", "req/rank", "max",
              "wall ms min", "wall median", "connect med", "server cpu");

  std::vector<result> results;
  int run_number = 0;
  for (const int world : cfg.ranks) {
    for (const reads how : {reads::batched, reads::per_key}) {
      if (how == reads::per_key && world > cfg.per_key_max) continue;
      for (const auto& server : servers) {
        result row;
        row.server = server.name();
        row.how = how;
        row.ranks = world;
        for (int r = 0; r < cfg.repeat; ++r) {
          const double cpu_before = server.cpu_ms();
          run_once(server.port(), "bench" + std::to_string(run_number++) + "/", world, how, row);
          row.server_cpu_ms.push_back(server.cpu_ms() - cpu_before);
        }
        if (!row.failure.empty())
          std::printf("  %-26s %-8s %6d  FAILED: %s\n", row.server.c_str(), name_of(how), world, row.failure.c_str());
        else
          std::printf("  %-26s %-8s %6d %9.1f %5llu %12.1f %12.1f %12.1f %11.0f\n", row.server.c_str(), name_of(how),
                      world, row.requests_per_rank, static_cast<unsigned long long>(row.requests_max),
                      result::min_of(row.wall_ms), result::median_of(row.wall_ms), result::median_of(row.connect_ms),
                      result::median_of(row.server_cpu_ms));
        std::fflush(stdout);
        results.push_back(std::move(row));
      }
    }
  }
  std::printf(
      "# req/rank: messages each rank's client sent (VALIDATE and PING included; max: the busiest rank); "
      "wall: all ranks released at once until the last is done; connect: until the last is connected; server cpu: "
      "ms of CPU the server process used in the run (median); over %d run(s)\n",
      cfg.repeat);
  if (cfg.per_key_max < largest)
    std::printf("# per-key reads were run up to %d ranks (--per-key-max): they grow as N per rank, N^2 in all\n",
                cfg.per_key_max);

  if (!cfg.json_path.empty()) {
    using cohort::detail::json;
    json out = json::make_object();
    out.set("tool", "bench_rendezvous");
    out.set("repeat", cfg.repeat);
    json rows = json::make_array();
    for (const auto& row : results) {
      json item = json::make_object();
      item.set("server", row.server);
      item.set("reads", name_of(row.how));
      item.set("ranks", row.ranks);
      item.set("requests_per_rank", row.requests_per_rank);
      item.set("requests_max", row.requests_max);
      json walls = json::make_array();
      for (const double ms : row.wall_ms) walls.push_back(ms);
      item.set("wall_ms", walls);
      json connects = json::make_array();
      for (const double ms : row.connect_ms) connects.push_back(ms);
      item.set("connect_ms", connects);
      json cpu = json::make_array();
      for (const double ms : row.server_cpu_ms) cpu.push_back(ms);
      item.set("server_cpu_ms", cpu);
      if (!row.failure.empty()) item.set("failure", row.failure);
      rows.push_back(item);
    }
    out.set("results", rows);
    json skipped = json::make_array();
    for (const auto& line : not_measured) skipped.push_back(line);
    out.set("not_measured", skipped);
    std::ofstream(cfg.json_path) << out.dump(2) << "\n";
  }
  bool failed = false;
  for (const auto& row : results) failed = failed || !row.failure.empty();
  return failed ? 1 : 0;
}
