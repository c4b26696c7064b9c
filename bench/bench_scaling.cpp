// bench_scaling: will N ranks beat one? Trains the data-parallel example's MLP for K steps on
// 1 rank and on N ranks (threads, Gloo, training_state under ddp), each rank with the same
// per-device batch, and reports throughput, the ratio N-rank / 1-rank, and the scaling
// efficiency (ratio / N). Below 0.75 x N it says so: the communication is eating the gain.
//
//   bench_scaling [--ranks N] [--steps K] [--per-device-batch B] [--widths 256,512,512,16] [--json FILE]
#include <chrono>
#include <cohort/comm/gloo.hpp>
#include <cohort/comm/process_group.hpp>
#include <cohort/parallel/training_state.hpp>
#include <cohort/run/run_ranks.hpp>
#include <cohort/tools/detail/json.hpp>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "../examples/mlp.hpp"

namespace {

struct config {
  int ranks = 2;
  int steps = 6;
  std::size_t per_device_batch = 64;
  std::vector<std::size_t> widths{256, 512, 512, 16};
  std::string json_path;
};

// Seconds for `steps` synchronised steps on one rank of `pg` (after one warm-up step).
double train(cohort::process_group<cohort::gloo>& pg, const config& cfg) {
  const cohort_examples::mlp model(cfg.widths);
  const auto data = cohort_examples::synthetic_data::make(
      cfg.per_device_batch, model.input_width(), model.output_width(), 100 + static_cast<std::uint64_t>(pg.rank()));
  // The MLP's tensors back to back in one flat buffer, W_l and b_l in layer l; plain SGD.
  std::vector<cohort::region> regions;
  std::size_t elements = 0;
  for (const auto n : model.parameter_sizes()) {
    regions.push_back({"t" + std::to_string(regions.size()), elements, n, regions.size() / 2});
    elements += n;
  }
  std::vector<float> initial(elements);
  std::vector<std::span<float>> tensors;
  for (const auto& r : regions) tensors.push_back(std::span<float>(initial).subspan(r.offset, r.count));
  model.initialize(tensors, 7);
  cohort::training_state<cohort::gloo> ddp{pg, regions, {.sgd = cohort::sgd_options{.lr = 0.01}}};
  ddp.load_parameters(initial);
  // Under ddp the parameters stay where the views point; gradients where gradient() says.
  std::vector<cohort::training_state<cohort::gloo>::layer_view> views;
  for (std::size_t l = 0; l < ddp.layer_count(); ++l) views.push_back(ddp.gather(l));
  std::vector<std::span<float>> params, grads;
  for (std::size_t r = 0; r < regions.size(); ++r) params.push_back(views[regions[r].layer].param(r));
  auto step = [&] {
    grads.clear();
    for (std::size_t r = 0; r < regions.size(); ++r) grads.push_back(ddp.gradient(r));
    model.loss_and_gradients(params, grads, data.inputs, data.targets, cfg.per_device_batch,
                             [&](std::size_t t) { ddp.mark_ready(t); });
    ddp.step();
  };
  step();  // warm-up: first buckets, page faults
  pg.barrier().wait();
  const auto started = std::chrono::steady_clock::now();
  for (int s = 0; s < cfg.steps; ++s) step();
  pg.barrier().wait();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
}

double run(int world, const config& cfg) {
  double seconds = 0;
  cohort::run_ranks(world, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
    cohort::process_group<cohort::gloo> pg{store, env};
    const double mine = train(pg, cfg);
    if (env.rank == 0) seconds = mine;
  });
  return seconds;
}

std::vector<std::size_t> parse_widths(const std::string& text) {
  std::vector<std::size_t> widths;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) widths.push_back(std::stoul(item));
  return widths;
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
    if (arg == "--ranks")
      cfg.ranks = std::stoi(value());
    else if (arg == "--steps")
      cfg.steps = std::stoi(value());
    else if (arg == "--per-device-batch")
      cfg.per_device_batch = std::stoul(value());
    else if (arg == "--widths")
      cfg.widths = parse_widths(value());
    else if (arg == "--json")
      cfg.json_path = value();
    else {
      std::fprintf(
          stderr,
          "usage: bench_scaling [--ranks N] [--steps K] [--per-device-batch B] [--widths a,b,...] [--json FILE]\n");
      return 2;
    }
  }
  const double one = run(1, cfg);
  const double many = run(cfg.ranks, cfg);
  const double samples_one = static_cast<double>(cfg.per_device_batch) * cfg.steps / one;
  const double samples_many = static_cast<double>(cfg.per_device_batch) * cfg.steps * cfg.ranks / many;
  const double ratio = samples_many / samples_one;
  const double efficiency = ratio / cfg.ranks;
  std::size_t parameters = 0;
  for (auto n : cohort_examples::mlp(cfg.widths).parameter_sizes()) parameters += n;

  std::printf(
      "# scaling check: MLP of %zu parameters, %zu samples per rank per step, %d steps, Gloo ranks as threads\n",
      parameters, cfg.per_device_batch, cfg.steps);
  std::printf("# %6s %12s %14s %10s %11s\n", "ranks", "step (ms)", "samples/s", "ratio", "efficiency");
  std::printf("  %6d %12.2f %14.1f %10.2f %10.0f%%\n", 1, 1e3 * one / cfg.steps, samples_one, 1.0, 100.0);
  std::printf("  %6d %12.2f %14.1f %10.2f %10.0f%%\n", cfg.ranks, 1e3 * many / cfg.steps, samples_many, ratio,
              100 * efficiency);
  if (efficiency < 0.75)
    std::printf(
        "# %d ranks give %.2fx the throughput of one (%.0f%% efficiency, under 75%%): the communication is "
        "eating it -- larger per-device batches, fewer synchronisations (no_sync accumulation), or a faster "
        "link; run cohort-plan for the numbers\n",
        cfg.ranks, ratio, 100 * efficiency);
  else
    std::printf("# %d ranks give %.2fx the throughput of one (%.0f%% efficiency)\n", cfg.ranks, ratio,
                100 * efficiency);
  std::printf(
      "# (each rank is a thread: on a machine with fewer cores than ranks x 2 the ranks share cores, and the "
      "ratio shows that too)\n");

  if (!cfg.json_path.empty()) {
    using cohort::detail::json;
    json out = json::make_object();
    out.set("tool", "bench_scaling");
    out.set("parameters", parameters);
    out.set("per_device_batch", cfg.per_device_batch);
    out.set("steps", cfg.steps);
    out.set("ranks", cfg.ranks);
    out.set("seconds_one_rank", one);
    out.set("seconds_n_ranks", many);
    out.set("samples_per_second_one_rank", samples_one);
    out.set("samples_per_second_n_ranks", samples_many);
    out.set("throughput_ratio", ratio);
    out.set("scaling_efficiency", efficiency);
    out.set("communication_bound", efficiency < 0.75);
    std::ofstream(cfg.json_path) << out.dump(2) << "\n";
  }
  return 0;
}
