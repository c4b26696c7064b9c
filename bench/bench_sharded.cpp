// Sharded parameters against data parallelism, both through training_state, on Gloo ranks
// as threads over loopback.
//
//   bench_sharded [--ranks 4] [--units 16] [--unit-mib 4] [--steps 3] [--compute-us 2000] [--json FILE]
//
// A stack of equal layers is trained for a few steps (plain SGD: the optimizer costs next to
// nothing) with the same loop under zero3 and ddp: the forward gathers every layer, the
// backward gathers it again, writes its gradient and marks it ready, then step(). Under
// zero3 (FSDP / ZeRO-3) the gathers are all-gathers, with prefetch depth 0, 1 and 2, and the
// gradients are reduce-scattered; under ddp the parameters stay resident and the gradients
// are all-reduced bucket by bucket. Each layer's compute is a sleep of --compute-us (an
// accelerator working while the host waits), which prefetch and the bucketed reductions can
// overlap. Reported per step: time, the bytes each rank put on the wire as the state counts
// them (bus bytes, nccl-tests convention) next to the formulas 3(n-1)/n x P (zero3) and
// 2(n-1)/n x P (ddp), and each rank's memory next to the unsharded footprint (full
// parameters + full gradients).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cohort/comm/gloo.hpp"
#include "cohort/comm/process_group.hpp"
#include "cohort/parallel/training_state.hpp"
#include "cohort/rendezvous/store.hpp"
#include "cohort/run/run_ranks.hpp"
#include "cohort/tools/detail/json.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
using group = cohort::process_group<cohort::gloo>;

struct config {
  int ranks = 4;
  std::size_t units = 16;
  double unit_mib = 4;
  int steps = 3;
  int compute_us = 2000;
  std::string json_path;
};

struct result {
  std::string mode;
  int prefetch = 0;
  double step_ms = 0;
  double counted_bytes = 0;  // per rank per step
  double formula_bytes = 0;
  double peak_bytes = 0;  // per rank: parameters and gradients, pooled buffers at their peak
};

group make_group(const std::shared_ptr<cohort::store>& store, const cohort::launch_env& env) {
  cohort::gloo::options opts;
  opts.timeout = std::chrono::seconds(60);
  return group(store, env, opts);
}

void compute(const config& cfg) { std::this_thread::sleep_for(std::chrono::microseconds(cfg.compute_us)); }

// One layer per unit, a bucket per layer.
result run_state(const config& cfg, cohort::strategy kind, int prefetch) {
  const std::size_t elements = static_cast<std::size_t>(cfg.unit_mib * (1 << 20)) / sizeof(float);
  const double total_bytes = static_cast<double>(elements * sizeof(float) * cfg.units);
  const double n = cfg.ranks;
  const bool sharded = kind == cohort::strategy::zero3;
  result out;
  out.mode = std::string(cohort::to_string(kind));
  out.prefetch = prefetch;
  out.formula_bytes = (sharded ? 3 : 2) * (n - 1) / n * total_bytes;
  std::vector<cohort::region> regions;
  for (std::size_t u = 0; u < cfg.units; ++u)
    regions.push_back({"unit." + std::to_string(u), u * elements, elements, u});
  cohort::run_ranks(cfg.ranks, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
    const int rank = env.rank;
    auto pg = make_group(store, env);
    cohort::training_state<cohort::gloo> state(pg, regions,
                                               {.strategy = kind,
                                                .bucket_bytes = elements * sizeof(float),
                                                .sgd = cohort::sgd_options{.lr = 1e-3},
                                                .prefetch = prefetch});
    std::vector<float> initial(elements * cfg.units);
    for (std::size_t i = 0; i < initial.size(); ++i) initial[i] = static_cast<float>(i % 7);
    state.load_parameters(initial);
    auto step = [&] {
      for (std::size_t u = 0; u < cfg.units; ++u) {
        auto layer = state.gather(u);
        compute(cfg);
      }
      for (std::size_t u = cfg.units; u-- > 0;) {
        auto layer = state.gather(u);
        compute(cfg);
        const auto gradient = state.gradient(u);
        std::fill(gradient.begin(), gradient.end(), 0.5f);
        state.mark_ready(u);
      }
      (void)state.step();
    };
    step();  // warm-up: connections, first allocations
    pg.barrier().wait();
    const auto start = clock_type::now();
    std::size_t moved = 0;
    for (int s = 0; s < cfg.steps; ++s) {
      step();
      moved += state.wire_bytes_per_step();
    }
    pg.barrier().wait();
    const double seconds = std::chrono::duration<double>(clock_type::now() - start).count();
    if (rank == 0) {
      out.step_ms = seconds * 1e3 / cfg.steps;
      out.counted_bytes = static_cast<double>(moved) / cfg.steps;
      const auto memory = state.memory();
      out.peak_bytes = static_cast<double>(memory.parameters + memory.gradients);
    }
  });
  return out;
}

config parse(int argc, char** argv) {
  config cfg;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--ranks")
      cfg.ranks = std::stoi(value());
    else if (arg == "--units")
      cfg.units = std::stoul(value());
    else if (arg == "--unit-mib")
      cfg.unit_mib = std::stod(value());
    else if (arg == "--steps")
      cfg.steps = std::stoi(value());
    else if (arg == "--compute-us")
      cfg.compute_us = std::stoi(value());
    else if (arg == "--json")
      cfg.json_path = value();
    else
      throw std::runtime_error("unknown argument " + arg +
                               " (usage: bench_sharded [--ranks N] [--units U] [--unit-mib M] [--steps S] "
                               "[--compute-us C] [--json FILE])");
  }
  if (cfg.ranks < 1 || cfg.units < 1 || cfg.steps < 1 || cfg.unit_mib <= 0)
    throw std::runtime_error("--ranks, --units, --steps and --unit-mib must be positive");
  return cfg;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const config cfg = parse(argc, argv);
    std::vector<result> results;
    for (int prefetch : {0, 1, 2}) results.push_back(run_state(cfg, cohort::strategy::zero3, prefetch));
    results.push_back(run_state(cfg, cohort::strategy::ddp, 0));
    const double mib = 1 << 20;
    const double total =
        static_cast<double>(static_cast<std::size_t>(cfg.unit_mib * mib) / sizeof(float) * sizeof(float) * cfg.units);
    std::printf(
        "bench_sharded: %d Gloo ranks (threads, loopback), %zu units x %.2f MiB = %.1f MiB of fp32 parameters, "
        "%d steps, %d us compute per unit and pass\n",
        cfg.ranks, cfg.units, cfg.unit_mib, total / mib, cfg.steps, cfg.compute_us);
    std::printf("%-14s %8s %10s %16s %16s %14s\n", "strategy", "prefetch", "step ms", "moved MiB/rank", "formula MiB",
                "peak MiB/rank");
    for (const auto& r : results)
      std::printf("%-14s %8s %10.1f %16.2f %16.2f %14.2f\n", r.mode.c_str(),
                  r.mode == "zero3" ? std::to_string(r.prefetch).c_str() : "-", r.step_ms, r.counted_bytes / mib,
                  r.formula_bytes / mib, r.peak_bytes / mib);
    std::printf("unsharded footprint (parameters + gradients): %.2f MiB per rank\n", 2 * total / mib);
    if (!cfg.json_path.empty()) {
      using cohort::detail::json;
      json doc = json::make_object();
      doc.set("benchmark", "bench_sharded");
      doc.set("backend", "gloo");
      doc.set("ranks", cfg.ranks);
      doc.set("units", static_cast<unsigned long>(cfg.units));
      doc.set("unit_bytes", static_cast<double>(total / static_cast<double>(cfg.units)));
      doc.set("parameter_bytes", total);
      doc.set("steps", cfg.steps);
      doc.set("compute_us", cfg.compute_us);
      doc.set("unsharded_bytes", 2 * total);
      json rows = json::make_array();
      for (const auto& r : results) {
        json row = json::make_object();
        row.set("strategy", r.mode);
        if (r.mode == "zero3") row.set("prefetch", r.prefetch);
        row.set("step_ms", r.step_ms);
        row.set("moved_bytes_per_rank", r.counted_bytes);
        row.set("formula_bytes_per_rank", r.formula_bytes);
        row.set("peak_bytes_per_rank", r.peak_bytes);
        rows.push_back(std::move(row));
      }
      doc.set("results", std::move(rows));
      std::ofstream file(cfg.json_path);
      file << doc.dump(2) << "\n";
      if (!file) throw std::runtime_error("cannot write " + cfg.json_path);
    }
    return 0;
  } catch (const std::exception& failure) {
    std::fprintf(stderr, "bench_sharded: %s\n", failure.what());
    return 1;
  }
}
