// cohort-bench-mpi: cohort's host all-reduce (the Gloo backend; shared memory when the ranks
// share a host) and Open MPI's MPI_Allreduce side by side, in the same processes, at the same
// moments: blocks of calls alternate between the two, so a busy machine slows both alike.
// Built where CMake finds MPI (apt-get install libopenmpi-dev).
//
//   mpirun -np 2 --bind-to none cohort-bench-mpi                     # 1K 64K 1M 64M
//   mpirun -np 2 --bind-to none cohort-bench-mpi -n 50 -r 7 4K 16M   # sizes of your own
//   mpirun -np 2 --bind-to none cohort-bench-mpi --min                # the fastest block
//
// Columns: the size of the whole buffer; the median (--min: the fastest, which drops the
// blocks a busy machine preempted) over repetition blocks of a call's mean time in a block
// (the slowest rank's), for cohort and for Open MPI; their ratio. Float sums of
// small integers, checked equal on both sides (a wrong element makes the exit status 1).

// MPI's C interface only (Open MPI's and MPICH's deprecated C++ bindings need a library of
// their own).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cohort/comm/gloo.hpp"
#include "cohort/comm/process_group.hpp"
#include "cohort/rendezvous/launch.hpp"
#include "cohort/rendezvous/tcp_store.hpp"

namespace {

struct settings {
  int iterations = 20;   // calls per timed block
  int repetitions = 5;   // blocks per side, alternating; the median counts
  bool fastest = false;  // the fastest block counts instead
  std::vector<std::size_t> sizes;
};

std::size_t parse_size(const std::string& text) {
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  const std::string suffix(end);
  const double scale = suffix == "K" ? 1024.0 : suffix == "M" ? 1048576.0 : suffix == "G" ? 1073741824.0 : 1.0;
  if (end == text.c_str() || value <= 0 || (!suffix.empty() && scale == 1.0)) {
    std::fprintf(stderr, "cohort-bench-mpi: \"%s\" is not a size (K, M, G: powers of 1024)\n", text.c_str());
    std::exit(2);
  }
  return static_cast<std::size_t>(value * scale);
}

settings parse(int argc, char** argv) {
  settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--min")
      s.fastest = true;
    else if ((arg == "-n" || arg == "-r") && i + 1 < argc)
      (arg == "-n" ? s.iterations : s.repetitions) = std::max(1, std::atoi(argv[++i]));
    else
      s.sizes.push_back(parse_size(arg));
  }
  if (s.sizes.empty()) s.sizes = {1024, 64 * 1024, 1024 * 1024, 64 * 1024 * 1024};
  return s;
}

double statistic(std::vector<double> values, bool fastest) {
  std::sort(values.begin(), values.end());
  return fastest ? values.front() : values[values.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const settings s = parse(argc, argv);
  int code = 0;
  {
    const auto env = cohort::launch_env::detect();
    auto store = cohort::connect_store(env);
    cohort::process_group<cohort::gloo> pg(store, env);
    const bool main_rank = env.rank == 0;
    if (main_rank)
      std::printf(
          "# cohort-bench-mpi: %d ranks, float sum, %d calls a block, %s of %d blocks a side\n"
          "# cohort's transport: %s\n#%11s %14s %14s %10s\n",
          env.world_size, s.iterations, s.fastest ? "fastest" : "median", s.repetitions,
          pg.backend().uses_shared_memory() ? "shared memory" : "Gloo's TCP", "size", "cohort (us)", "Open MPI (us)",
          "cohort/MPI");
    for (const std::size_t bytes : s.sizes) {
      const std::size_t count = std::max<std::size_t>(1, bytes / sizeof(float));
      std::vector<float> in(count), ours(count), theirs(count);
      for (std::size_t i = 0; i < count; ++i) in[i] = static_cast<float>((env.rank * 5 + i * 3) % 11);
      const auto cohort_call = [&] { pg.all_reduce(std::span<const float>(in), std::span<float>(ours)).wait(); };
      const auto mpi_call = [&] {
        MPI_Allreduce(in.data(), theirs.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      };
      // A block's mean call time on the slowest rank (every rank starts it together).
      const auto block = [&](const auto& call) {
        MPI_Barrier(MPI_COMM_WORLD);
        const auto started = std::chrono::steady_clock::now();
        for (int i = 0; i < s.iterations; ++i) call();
        double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - started).count() /
                    s.iterations;
        MPI_Allreduce(MPI_IN_PLACE, &us, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        return us;
      };
      for (int i = 0; i < 3; ++i) {  // warm-up: pages touched, connections made
        cohort_call();
        mpi_call();
      }
      std::vector<double> cohort_us, mpi_us;
      for (int r = 0; r < s.repetitions; ++r) {
        cohort_us.push_back(block(cohort_call));
        mpi_us.push_back(block(mpi_call));
      }
      int wrong = ours != theirs ? 1 : 0;
      MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
      code = std::max(code, wrong);
      const double ours_us = statistic(cohort_us, s.fastest), theirs_us = statistic(mpi_us, s.fastest);
      if (main_rank)
        std::printf("%12zu %14.2f %14.2f %10.2f%s\n", count * sizeof(float), ours_us, theirs_us, ours_us / theirs_us,
                    wrong ? "  (results differ)" : "");
      std::fflush(stdout);
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
  MPI_Finalize();
  return code;
}
