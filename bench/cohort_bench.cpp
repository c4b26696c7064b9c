// cohort-bench: what a collective really delivers on this machine, in nccl-tests' columns,
// next to the same call made straight on the engine (the wrapper's overhead).
//
//   cohort-bench all_reduce --backend gloo --ranks 2 -b 1K -e 64M -f 2 --json out.json
//   mpirun -np 2 cohort-bench all_reduce --backend gloo -b 1K -e 1M
//   torchrun --nproc-per-node 8 --no-python cohort-bench all_reduce --backend nccl
//
// The measuring core is bench/bench_common.hpp; this file parses options, starts the ranks
// (threads, or the processes of a launcher), and prints and writes the results.

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iostream>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "bench_common.hpp"
#include "cohort/rendezvous/launch.hpp"
#include "cohort/rendezvous/store.hpp"
#include "cohort/rendezvous/tcp_store.hpp"
#include "cohort/tools/topology.hpp"

namespace {

constexpr const char* usage = R"(usage: cohort-bench <operation> [options]

Operations: all_reduce, all_gather, reduce_scatter, broadcast, all_to_all (or nccl-tests' alltoall)

  --backend B          gloo (host memory over TCP) or nccl (GPU memory); default gloo
  --ranks N            run N ranks as threads of this process (NCCL: one GPU each). Without it
                       the launcher's environment is read (mpirun, torchrun --no-python, srun);
                       with no launcher: 2 ranks on gloo, every visible GPU on nccl
  -b, --minbytes SIZE  smallest size (default 8); K, M, G suffixes are powers of 1024
  -e, --maxbytes SIZE  largest size (default 128M on gloo, 8G on nccl)
  -f, --stepfactor F   multiply the size by F each step (default 2)
  -n, --iters N        iterations per timed block (default 20)
  -w, --warmup_iters N warm-up iterations per size (default 5)
  -r, --repetitions R  timed blocks per size, alternating cohort and raw; the median counts
                       (default 3)
  -d, --datatype T     float, double, half, bfloat16, int32, int64, uint8 (default float)
  -o, --op OP          sum, prod, min, max, avg (default sum)
  --root R             broadcast root (default 0)
  -c, --check 0|1      check every result against an independent computation (default 1)
  --stat median|min    which timed block counts (default median; min drops blocks that a
                       busy machine preempted)
  --no-raw             do not time the raw engine call next to cohort's
  --pairs P            single calls per side, interleaved cohort / raw, behind the cohort/raw
                       column: the ratio of their medians (default iters x repetitions)
  --json FILE          write every row and the environment as JSON (rank 0)
  --timeout SECONDS    bound of every collective and of the rendezvous (default 300)
  --recorder N         flight-recorder entries of the measured group (default 2048, as a
                       group's default; 0 turns the recorder off, to see what it costs)
  -h, --help           this text

Columns follow nccl-tests: size is the full buffer in bytes, time the mean of one call in
microseconds averaged over ranks, algbw = size / time, busbw = algbw x 2(n-1)/n (all_reduce),
(n-1)/n (all_gather, reduce_scatter, all_to_all), 1 (broadcast). cohort/raw is the median time
of a raw engine call over that of cohort's, from single calls interleaved one by one (>= 0.98
means the wrapper costs under 2%).
)";

[[noreturn]] void fail(const std::string& message, int code = 2) {
  std::cerr << "cohort-bench: " << message << "\n";
  if (code == 2) std::cerr << "(see cohort-bench --help)\n";
  std::exit(code);
}

std::size_t parse_size(const std::string& option, const std::string& text) {
  char* end = nullptr;
  errno = 0;
  const double value = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || errno == ERANGE || value < 0) fail(option + ": \"" + text + "\" is not a size");
  double scale = 1;
  std::string suffix(end);
  if (!suffix.empty() && (suffix.back() == 'B' || suffix.back() == 'b') && suffix.size() > 1) suffix.pop_back();
  if (suffix == "K" || suffix == "k")
    scale = 1024.0;
  else if (suffix == "M" || suffix == "m")
    scale = 1024.0 * 1024;
  else if (suffix == "G" || suffix == "g")
    scale = 1024.0 * 1024 * 1024;
  else if (suffix == "T" || suffix == "t")
    scale = 1024.0 * 1024 * 1024 * 1024;
  else if (!suffix.empty() && suffix != "B" && suffix != "b")
    fail(option + ": unknown suffix in \"" + text + "\"");
  return static_cast<std::size_t>(value * scale);
}

int parse_int(const std::string& option, const std::string& text, int least) {
  char* end = nullptr;
  errno = 0;
  const long value = std::strtol(text.c_str(), &end, 10);
  if (end == text.c_str() || *end || errno == ERANGE || value < least || value > 1 << 30)
    fail(option + ": \"" + text + "\" is not an integer >= " + std::to_string(least));
  return static_cast<int>(value);
}

std::optional<cohort::dtype> parse_dtype(const std::string& name) {
  using cohort::dtype;
  if (name == "float" || name == "float32" || name == "fp32") return dtype::float32;
  if (name == "double" || name == "float64" || name == "fp64") return dtype::float64;
  if (name == "half" || name == "float16" || name == "fp16") return dtype::float16;
  if (name == "bfloat16" || name == "bf16") return dtype::bfloat16;
  if (name == "int32" || name == "int") return dtype::int32;
  if (name == "int64") return dtype::int64;
  if (name == "uint8") return dtype::uint8;
  return std::nullopt;
}

std::optional<cohort::op> parse_op(const std::string& name) {
  using cohort::op;
  if (name == "sum") return op::sum;
  if (name == "prod" || name == "product") return op::product;
  if (name == "min") return op::min;
  if (name == "max") return op::max;
  if (name == "avg") return op::avg;
  return std::nullopt;
}

struct command_line {
  cohort_bench::options bench;
  std::optional<int> ranks;
  std::string json_path;
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  std::size_t recorder_entries = 2048;
  bool max_given = false;
};

command_line parse(int argc, char** argv) {
  command_line cl;
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) fail("no operation given");
  if (args[0] == "-h" || args[0] == "--help") {
    std::cout << usage;
    std::exit(0);
  }
  const auto what = cohort_bench::parse_operation(args[0]);
  if (!what)
    fail("unknown operation \"" + args[0] + "\": all_reduce, all_gather, reduce_scatter, broadcast, all_to_all");
  cl.bench.what = *what;
  for (std::size_t i = 1; i < args.size(); ++i) {
    const std::string& flag = args[i];
    auto value = [&]() -> const std::string& {
      if (i + 1 >= args.size()) fail(flag + " needs a value");
      return args[++i];
    };
    if (flag == "-h" || flag == "--help") {
      std::cout << usage;
      std::exit(0);
    } else if (flag == "--backend") {
      cl.bench.backend = value();
      if (cl.bench.backend != "gloo" && cl.bench.backend != "nccl") fail("--backend: gloo or nccl");
    } else if (flag == "--ranks") {
      cl.ranks = parse_int(flag, value(), 1);
    } else if (flag == "-b" || flag == "--minbytes") {
      cl.bench.min_bytes = parse_size(flag, value());
    } else if (flag == "-e" || flag == "--maxbytes") {
      cl.bench.max_bytes = parse_size(flag, value());
      cl.max_given = true;
    } else if (flag == "-f" || flag == "--stepfactor") {
      cl.bench.factor = static_cast<std::size_t>(parse_int(flag, value(), 2));
    } else if (flag == "-n" || flag == "--iters") {
      cl.bench.iterations = parse_int(flag, value(), 1);
    } else if (flag == "-w" || flag == "--warmup_iters") {
      cl.bench.warmup = parse_int(flag, value(), 0);
    } else if (flag == "-r" || flag == "--repetitions") {
      cl.bench.repetitions = parse_int(flag, value(), 1);
    } else if (flag == "-d" || flag == "--datatype") {
      const auto type = parse_dtype(value());
      if (!type) fail(flag + ": float, double, half, bfloat16, int32, int64 or uint8");
      cl.bench.type = *type;
    } else if (flag == "-o" || flag == "--op") {
      const auto reduce = parse_op(value());
      if (!reduce) fail(flag + ": sum, prod, min, max or avg");
      cl.bench.reduce = *reduce;
    } else if (flag == "--root") {
      cl.bench.root = parse_int(flag, value(), 0);
    } else if (flag == "-c" || flag == "--check") {
      cl.bench.check = parse_int(flag, value(), 0) != 0;
    } else if (flag == "--stat") {
      const std::string& name = value();
      if (name != "median" && name != "min") fail("--stat: median or min");
      cl.bench.fastest_block = name == "min";
    } else if (flag == "--pairs") {
      cl.bench.ratio_pairs = parse_int(flag, value(), 1);
    } else if (flag == "--no-raw") {
      cl.bench.compare_raw = false;
    } else if (flag == "--json") {
      cl.json_path = value();
    } else if (flag == "--timeout") {
      cl.timeout = std::chrono::seconds(parse_int(flag, value(), 1));
    } else if (flag == "--recorder") {
      cl.recorder_entries = static_cast<std::size_t>(parse_int(flag, value(), 0));
    } else {
      fail("unknown option \"" + flag + "\"");
    }
  }
  if (!cl.max_given && cl.bench.backend == "nccl") cl.bench.max_bytes = std::size_t(8) << 30;
  if (cl.bench.min_bytes > cl.bench.max_bytes)
    fail("-b " + std::to_string(cl.bench.min_bytes) + " is larger than -e " + std::to_string(cl.bench.max_bytes));
  return cl;
}

std::string host_name() {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  return name;
}

// The environment block of the JSON file; `ranks_hosts` and `gpus` were gathered from every rank.
cohort::detail::json describe_environment(const command_line& cl, const cohort::launch_env& env, bool threads,
                                          const std::vector<std::string>& ranks_hosts,
                                          const std::vector<std::string>& gpus) {
  using cohort::detail::json;
  json e = json::make_object();
  e.set("backend", cl.bench.backend);
  e.set("world", env.world_size);
  e.set("ranks_as", threads ? "threads of one process" : "processes");
  e.set("launcher", std::string(cohort::to_string(env.source)));
  json hosts = json::make_array();
  for (const auto& h : ranks_hosts) hosts.push_back(h);
  e.set("hosts", std::move(hosts));
  e.set("cpu_cores", static_cast<int>(std::thread::hardware_concurrency()));
  json gpu_list = json::make_array();
  for (const auto& g : gpus) gpu_list.push_back(g);
  e.set("gpus", std::move(gpu_list));
  const cohort::topology topo = cohort::probe_topology();
  if (topo.size() > 0) {
    e.set("link_topology", cohort::format_topology_matrix(topo));
    e.set("suggested_link_preset", cohort::suggested_link_preset(topo));
  } else {
    e.set("link_topology", cl.bench.backend == "gloo" ? "host: loopback or sockets (Gloo over TCP)" : "unknown");
  }
  json notes = json::make_array();
  for (const auto& note : topo.notes) notes.push_back(note);
  e.set("topology_notes", std::move(notes));
#if defined(COHORT_HAS_NCCL)
  int version = 0;
  if (ncclGetVersion(&version) == ncclSuccess) e.set("nccl_version", version);
  int runtime = 0;
  if (cudaRuntimeGetVersion(&runtime) == cudaSuccess) e.set("cuda_runtime_version", runtime);
#else
  e.set("nccl_version", json());
#endif
  e.set("gloo", "libgloo (Debian libgloo-dev), TCP transport");
  e.set("cohort_version", COHORT_VERSION_STRING);
#if defined(__VERSION__)
  e.set("compiler", __VERSION__);
#endif
  e.set("timing", cl.bench.backend == "gloo"
                      ? "each iteration issue + wait; median of repetition blocks; mean over ranks"
                      : "iterations back to back, last waited; median of repetition blocks; mean over ranks");
  return e;
}

// One rank's whole run on backend B. Returns the process exit code (rank 0's matters).
template <class B>
int run_rank(const command_line& cl, std::shared_ptr<cohort::store> store, const cohort::launch_env& env,
             bool threads) {
  cohort::gloo::options control_options;
  control_options.timeout = cl.timeout;
  // The control group first, so every rank creates its groups in the same order.
  cohort::process_group<cohort::gloo> control{store, env, control_options};
  typename B::options data_options;
  data_options.timeout = cl.timeout;
  data_options.flight_recorder_entries = cl.recorder_entries;
  cohort::process_group<B> pg{store, env, data_options};

  std::string gpu = "-";
#if defined(COHORT_HAS_NCCL)
  if constexpr (std::is_same_v<B, cohort::nccl>) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, pg.backend().device()) == cudaSuccess) {
      char bus[32] = {};
      cudaDeviceGetPCIBusId(bus, sizeof bus, pg.backend().device());
      gpu = std::string(prop.name) + " [" + bus + "]";
    }
  }
#endif
  auto& shared = *control.group_store();
  shared.set("bench/host/" + std::to_string(env.rank), host_name() + " pid " + std::to_string(getpid()));
  shared.set("bench/gpu/" + std::to_string(env.rank), gpu);

  const bool main = env.rank == 0;
  cohort_bench::options o = cl.bench;
  if (o.root >= env.world_size) {
    if (main) std::cerr << "cohort-bench: --root " << o.root << " outside a world of " << env.world_size << "\n";
    return 2;
  }
  if (main) {
    std::vector<std::string> hosts, gpus;
    for (int r = 0; r < env.world_size; ++r) {
      hosts.push_back(shared.get_string("bench/host/" + std::to_string(r)));
      gpus.push_back(shared.get_string("bench/gpu/" + std::to_string(r)));
    }
    std::printf(
        "# cohort-bench %s: backend %s, %d rank(s) as %s, %s; minBytes %zu maxBytes %zu step: %zu(factor) "
        "warmup iters: %d iters: %d repetitions: %d validation: %d\n",
        std::string(cohort_bench::to_string(o.what)).c_str(), o.backend.c_str(), env.world_size,
        threads ? "threads" : "processes", std::string(cohort::to_string(env.source)).c_str(), o.min_bytes, o.max_bytes,
        o.factor, o.warmup, o.iterations, o.repetitions, o.check ? 1 : 0);
    std::printf("#\n# Using devices\n");
    for (int r = 0; r < env.world_size; ++r)
      std::printf("#  Rank %2d on %s device %s\n", r, hosts[std::size_t(r)].c_str(), gpus[std::size_t(r)].c_str());
    if constexpr (std::is_same_v<B, cohort::gloo>) {
      const bool shared_memory = pg.backend().uses_shared_memory();
      const bool moved_there = o.what == cohort_bench::operation::all_reduce ||
                               o.what == cohort_bench::operation::reduce_scatter ||
                               o.what == cohort_bench::operation::all_gather;
      if (shared_memory && moved_there)
        std::printf(
            "#\n# cohort's group moves this collective through shared memory (its ranks share a host); the raw\n"
            "# columns are Gloo's own TCP, so cohort / raw is the transport's gain here, not the wrapper's cost\n"
            "# (COHORT_GLOO_SHARED_MEMORY=0 measures the wrapper over the same transport)\n");
    }
    std::printf("#\n%s", cohort_bench::header(o).c_str());
    std::fflush(stdout);
    auto rows = cohort_bench::run(pg, control, o, [&](const cohort_bench::row& r) {
      std::fputs(cohort_bench::format_row(o, r).c_str(), stdout);
      std::fflush(stdout);
    });
    std::fputs(cohort_bench::footer(rows).c_str(), stdout);
    std::fflush(stdout);
    if (!cl.json_path.empty()) {
      const auto document =
          cohort_bench::to_json(o, env.world_size, rows, describe_environment(cl, env, threads, hosts, gpus));
      std::ofstream out(cl.json_path, std::ios::binary | std::ios::trunc);
      out << document.dump(1) << "\n";
      if (!out) {
        std::cerr << "cohort-bench: cannot write " << cl.json_path << "\n";
        return 1;
      }
      std::printf("# results written to %s\n", cl.json_path.c_str());
    }
    control.barrier().wait();  // the others leave only after rank 0 has read the store
    return cohort_bench::summarize(rows).wrong > 0 ? 1 : 0;
  }
  cohort_bench::run(pg, control, o);
  control.barrier().wait();
  return 0;
}

template <class B>
int run_all(const command_line& cl, int gpu_count) {
  const char* backend = cl.bench.backend.c_str();
  auto detected = cohort::launch_env::detect();
  const bool launched = detected.source != cohort::launcher::explicit_values || detected.world_size > 1;
  if (!cl.ranks && launched) {
    cohort::tcp_store_options store_options;
    store_options.timeout = cl.timeout;
    auto store = cohort::connect_store(detected, store_options);
    return run_rank<B>(cl, std::move(store), detected, false);
  }
  int ranks = cl.ranks ? *cl.ranks : (std::string(backend) == "nccl" ? gpu_count : 2);
  if (std::string(backend) == "nccl" && ranks > gpu_count)
    fail("--ranks " + std::to_string(ranks) + " on nccl needs one GPU per rank, and " + std::to_string(gpu_count) +
             " are visible",
         1);
  auto store = std::make_shared<cohort::memory_store>();
  store->set_timeout(cl.timeout);
  std::vector<std::thread> threads;
  std::vector<int> codes(static_cast<std::size_t>(ranks), 0);
  std::mutex print;
  for (int rank = 0; rank < ranks; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        codes[std::size_t(rank)] = run_rank<B>(cl, store, cohort::launch_env::explicit_ranks(rank, ranks), true);
      } catch (const std::exception& failure) {
        std::lock_guard lock(print);
        std::cerr << "cohort-bench: rank " << rank << ": " << failure.what() << "\n";
        codes[std::size_t(rank)] = 1;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  int code = 0;
  for (int c : codes) code = std::max(code, c);
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  const command_line cl = parse(argc, argv);
  try {
    if (cl.bench.backend == "gloo") return run_all<cohort::gloo>(cl, 0);
#if defined(COHORT_HAS_NCCL)
    int gpus = 0;
    const cudaError_t status = cudaGetDeviceCount(&gpus);
    if (status != cudaSuccess || gpus == 0)
      fail(std::string("--backend nccl needs a CUDA GPU, and none is visible (") +
               (status != cudaSuccess ? std::string("cudaGetDeviceCount: ") + cudaGetErrorString(status)
                                      : std::string("0 devices")) +
               "); use --backend gloo to measure host collectives",
           1);
    return run_all<cohort::nccl>(cl, gpus);
#else
    fail(
        "--backend nccl: this cohort-bench was built without CUDA and NCCL (configure cohort where nvcc and NCCL "
        "are found); use --backend gloo",
        1);
#endif
  } catch (const std::exception& failure) {
    std::cerr << "cohort-bench: " << failure.what() << "\n";
    return 1;
  }
}
