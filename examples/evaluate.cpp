// Evaluating a model on every rank without counting a sample twice.
//
//   evaluate --ranks 3                      # 3 ranks as threads of this process
//   evaluate --ranks 4 --samples 1000
//   mpirun -np 3 evaluate                   # or torchrun --nproc-per-node 3 --no-python evaluate
//
// Each rank reads its share of a shuffled dataset through cohort's distributed_sampler with
// drop_last off, so the sampler pads the ranks to equal length by repeating a few samples.
// Each rank scores its samples with a small fixed classifier and cohort::gather_for_metrics
// brings the per-sample results together in dataset order with the repeats removed. The
// accuracy then equals the one a single process computes over the whole dataset, which the
// program checks: its last line is
//   accuracy: distributed X, single process Y: match          (or MISMATCH, exit status 1)
#include <cohort/cohort.hpp>
#include <cohort/data/metrics.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "command_line.hpp"

namespace {

struct config {
  int ranks = 0;  // 0: read the launcher's environment
  std::uint64_t samples = 101;
};

// The synthetic dataset: sample i is a point in [-1, 1)^2 drawn from i alone (splitmix64),
// labelled by which side of the line u + 0.5 v = 0.1 it lies on.
struct sample {
  double u, v;
  int label;
};

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

sample load(std::uint64_t index) {
  const auto unit = [](std::uint64_t bits) { return static_cast<double>(bits >> 11) * 0x1.0p-53 * 2.0 - 1.0; };
  const double u = unit(splitmix64(2 * index));
  const double v = unit(splitmix64(2 * index + 1));
  return {u, v, u + 0.5 * v > 0.1 ? 1 : 0};
}

// The "model": a fixed linear classifier that is close to the true boundary but not on it,
// so its accuracy is neither 0 nor 1 and every sample's vote matters.
int predict(const sample& s) { return s.u + 0.3 * s.v > 0.0 ? 1 : 0; }

int run(cohort::process_group<cohort::gloo>& pg, const config& cfg) {
  // Shuffled and padded (drop_last off): with a dataset not divisible by the world, some
  // ranks read a repeated sample at the end of their share.
  cohort::distributed_sampler sampler{cfg.samples, pg, {.shuffle = true, .seed = 1234, .drop_last = false}};
  sampler.set_epoch(0);
  std::vector<std::uint8_t> correct;  // one per index this rank reads, padding included
  correct.reserve(static_cast<std::size_t>(sampler.size()));
  for (auto index : sampler) {
    const sample s = load(index);
    correct.push_back(predict(s) == s.label ? 1 : 0);
  }

  // What a naive sum would count: every index every rank read, repeats included.
  const auto naive = cohort::all_reduce_values(
      pg, {static_cast<std::int64_t>(correct.size()),
           static_cast<std::int64_t>(std::accumulate(correct.begin(), correct.end(), std::uint64_t{0}))});
  const std::int64_t read_in_all = naive[0];
  const auto gathered = cohort::gather_for_metrics(pg, correct, sampler, cohort::gather_destination::rank_zero);
  if (!cohort::is_main_process(pg)) return 0;

  const auto right = std::accumulate(gathered.begin(), gathered.end(), std::uint64_t{0});
  const double distributed = gathered.empty() ? 0.0 : static_cast<double>(right) / static_cast<double>(gathered.size());

  // One process over the whole dataset, in its natural order.
  std::uint64_t single_right = 0;
  for (std::uint64_t index = 0; index < cfg.samples; ++index) {
    const sample s = load(index);
    single_right += predict(s) == s.label ? 1 : 0;
  }
  const double single = cfg.samples == 0 ? 0.0 : static_cast<double>(single_right) / static_cast<double>(cfg.samples);

  std::printf("%d ranks read %lld samples of a dataset of %llu (%lld of them padding); gathered %zu values\n",
              pg.world_size(), static_cast<long long>(read_in_all), static_cast<unsigned long long>(cfg.samples),
              static_cast<long long>(read_in_all) - static_cast<long long>(cfg.samples), gathered.size());
  if (read_in_all > 0)
    std::printf("counting the padding too would give %.6f over %lld samples\n",
                static_cast<double>(naive[1]) / static_cast<double>(read_in_all), static_cast<long long>(read_in_all));
  const bool match = gathered.size() == cfg.samples && right == single_right && distributed == single;
  std::printf("accuracy: distributed %.6f, single process %.6f: %s\n", distributed, single,
              match ? "match" : "MISMATCH");
  return match ? 0 : 1;
}

config parse(int argc, char** argv) {
  config cfg;
  for (cohort_examples::command_line args(argc, argv); args.next();) {
    const std::string& arg = args.flag();
    if (arg == "--ranks")
      cfg.ranks = std::stoi(args.value());
    else if (arg == "--samples")
      cfg.samples = std::stoull(args.value());
    else {
      args.usage(
          "usage: evaluate [--ranks N] [--samples S]\n"
          "  without --ranks, ranks come from the launcher (mpirun, torchrun, srun)\n");
    }
  }
  return cfg;
}

}  // namespace

int main(int argc, char** argv) try {
  const config cfg = parse(argc, argv);
  int status = 0;
  cohort::run_ranks(cfg.ranks, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
    cohort::process_group<cohort::gloo> pg{store, env};
    const int mine = run(pg, cfg);
    if (cohort::is_main_process(pg)) status = mine;
  });
  return status;
} catch (const std::exception& failure) {
  std::fprintf(stderr, "evaluate: %s\n", failure.what());
  return 1;
}
