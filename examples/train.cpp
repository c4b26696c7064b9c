// One trainer, every strategy: the data-parallel example's MLP trained through
// cohort::training_state, whose one option picks data parallelism (ddp), sharded optimizer
// state (zero1), sharded gradients too (zero2) or sharded parameters too (zero3, FSDP). The
// training loop below is the same for all four: it gathers each layer before using it (free
// where parameters stay resident), writes each layer's gradients where the state says and
// marks them ready, and steps.
//
//   train --strategy zero3 --ranks 4            # 4 ranks as threads of this process
//   mpirun -np 4 train --strategy zero2         # or torchrun --nproc-per-node 4 --no-python train
//   train --ranks 3 --batches-per-rank 5,3,0    # uneven inputs: a join scope keeps them in step
//   COHORT_TIMELINE=tl train --ranks 4           # a timeline per rank: cohort-trace timeline tl
//   train --ranks 3 --steps 80 --slow-rank 1 --slow-from 30 --slow-ms 40   # the slowdown line
//   train --ranks 4 --checkpoint ckpt --save-every 5 --stop-after 9   # stopped after step 9
//   train --ranks 2 --strategy zero3 --checkpoint ckpt --resume       # continues at step 10
//   train --ranks 4 --checkpoint ckpt --save-every 4 --resume --kill-at-step 10  # a crash, then
//                                                # the same command again resumes after it
//   train --ranks 4 --reproducible --micro-batches 8   # the same parameters, bit for bit, at
//   train --ranks 2 --reproducible --micro-batches 8   # any world size: the same sha256 line
//   train --ranks 4 --nodes 2 --strategy zero3     # hybrid: 2 groups of 2 ranks, sharded within
//
// The parameters sit in one flat buffer laid out as llm.c lays out GPT-2's (tensor-major,
// stacked over the hidden layers: examples/flat_model.hpp). Each rank prints what it holds
// and what a step puts on the wire; rank 0 ends with the final loss against one process
// training on the whole batch with AdamW written out in double, and the parameters' digest
// (cohort::parameter_sha256: the same for the same parameters at any world size and strategy).
//
// Each step's batch comes from the sampler in micro-batch mode: one micro-batch per rank, or
// with --reproducible K micro-batches numbered alike at every world size, each rank running its
// run of K / N of them as micro-steps (all but the last in a no_sync scope).
#include <cohort/cohort.hpp>

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "train_common.hpp"

namespace {

using cohort_examples::config;
using cohort_examples::flat_layout;
using cohort_examples::mlp;

// One rank's training. The loop is the same whatever cfg.strategy says. `stopped` is set when
// --stop-after ended it early.
// What a run measured: its ms per step and, on rank 0, the straggler report's verdict.
struct run_measure {
  double ms_per_step = 0;
  // From the first step's end to the last's: the throughput a long run has, without the first
  // step's construction, first allocations and page faults (what the comparison reads).
  double steady_ms_per_step = 0;
  std::optional<cohort::scaling_verdict> verdict;
  std::string parameters_sha256;
};

// `timeline_directory`: where the timeline goes (empty: COHORT_TIMELINE's). `quiet`: a run of
// --compare-one-rank's rounds, which prints nothing (it measures).
std::vector<float> train(bool& stopped, run_measure& measured, cohort::process_group<cohort::gloo>& pg,
                         const config& cfg, const mlp& model, const flat_layout& layout,
                         const cohort_examples::synthetic_data& data, const std::string& timeline_directory = {},
                         bool quiet = false) {
  const bool prints = pg.rank() == 0 && !quiet;
  // COHORT_TIMELINE=DIR: each rank writes DIR/rank<R>.timeline.json (cohort-trace timeline
  // DIR merges them). The straggler report's windows watch for a slowdown: rank 0 writes one
  // line naming the rank when its lead over the others grows by 30% of the baseline step
  // (every rank alike: the step by 75%) for two windows in a row (slowdown_options' defaults).
  cohort::timeline timeline(pg, {.directory = timeline_directory});
  // The verdict counts each rank's compute in CPU time: ranks as threads share this host's
  // cores, which stretches each rank's wall-clock compute but not its CPU time.
  cohort::straggler_report stragglers(pg, {.every = 4,
                                           .output = nullptr,
                                           .slowdown = cohort::slowdown_options{},
                                           .slowdown_timeline = &timeline,
                                           .cpu_time_compute = true});
  // --nodes G: hybrid sharding over G groups of consecutive ranks (as nodes hold them): the
  // state shards within this rank's group; its replicas are the ranks at its place in the others.
  std::optional<cohort::process_group<cohort::gloo>> node, peers;
  if (cfg.nodes > 1) {
    const int per_node = pg.world_size() / cfg.nodes;
    node = pg.split(pg.rank() / per_node, pg.rank() % per_node);
    peers = pg.split(pg.rank() % per_node, pg.rank() / per_node);
  }
  const std::size_t world = static_cast<std::size_t>(pg.world_size());
  const std::size_t micro_batches = cfg.micro_batches_over(pg.world_size()), rows = cfg.batch / micro_batches;
  std::optional<cohort::reproducible_options> reproducible;
  if (cfg.reproducible) reproducible = cohort::reproducible_options{micro_batches, rows};
  cohort::training_state<cohort::gloo> state(node ? *node : pg, cohort_examples::regions_of(model, layout),
                                             {.strategy = cfg.strategy,
                                              .bucket_bytes = 64 << 10,
                                              .adam = cfg.adam,
                                              .max_grad_norm = cfg.max_grad_norm,
                                              .straggler = &stragglers,
                                              .timeline = &timeline,
                                              .reproducible = reproducible},
                                             peers ? &*peers : nullptr);
  // Rank r reads micro-batches [r K / N, (r + 1) K / N) of each step (its position: the rank, in
  // hybrid too); not shuffled, so that the one-process reference trains on the same rows.
  cohort::distributed_sampler sampler{
      data.samples, pg, {.shuffle = false, .micro_batches = micro_batches, .micro_batch_size = rows}};
  const std::size_t micro_steps = micro_batches / world;
  const cohort::batch_sequence batches{sampler, static_cast<int>(rows), static_cast<int>(micro_steps)};
  state.load_parameters(cohort_examples::initial_parameters(model, layout));
  // The data is indexed by step: the sampler's position is the next step, kept in the
  // checkpoint's metadata with the data's seed.
  int first_step = 0;
  if (cfg.resume && !cfg.checkpoint.empty())
    if (const auto resumed = cohort::resume_checkpoint(state, cfg.checkpoint)) {
      first_step = std::stoi(resumed->metadata.at("next_step"));
      if (pg.rank() == 0)
        std::printf(
            "resumed from %s (saved at %d ranks under %s, %llu bytes read here, %.3f s): continuing at step %d\n",
            resumed->path.c_str(), resumed->world_size, resumed->strategy.c_str(),
            static_cast<unsigned long long>(resumed->bytes_read), resumed->seconds, first_step);
    }
  // Periodic saves are asynchronous: the copy into host staging overlaps the next step's
  // forward and backward (its step() waits for it), and each commits as soon as every rank's
  // file is durable, so a SIGKILL resumes from the newest save written before it; the last
  // step's is waited for.
  // (Only with --checkpoint: hybrid states are saved by save_checkpoint, not asynchronously.)
  std::optional<cohort::async_checkpointer<cohort::gloo, float, float>> saver;
  if (!cfg.checkpoint.empty()) saver.emplace(state);
  const auto report = [&](const std::optional<cohort::checkpoint_info>& saved) {
    if (saved && pg.rank() == 0)
      std::printf("saved %s (%llu bytes from rank 0, %.3f s, training blocked %.3f s)\n", saved->path.c_str(),
                  static_cast<unsigned long long>(saved->bytes_written), saved->seconds, saver->last_blocked_seconds());
  };
  const auto save = [&](int step, bool last) {
    report(saver->save(cfg.checkpoint, static_cast<std::uint64_t>(step),
                       {.metadata = {{"next_step", std::to_string(step + 1)}, {"data_seed", "2024"}}, .keep_last = 3}));
    if (last) report(saver->wait());
  };
  const std::size_t layers = model.layers();
  std::vector<std::vector<float>> activation(layers + 1);
  std::vector<float> losses;  // this rank's micro-batches' in this step
  // One micro-batch: forward, backward, its gradients (of its mean loss) marked layer by layer.
  const auto micro_step = [&](int step, std::size_t k) {
    const auto indices = batches[static_cast<std::size_t>(step) * micro_steps + k].indices;
    activation[0] = cohort_examples::rows_at(data.inputs, indices, model.input_width());
    auto forward = timeline.span("forward");
    for (std::size_t l = 0; l < layers; ++l) {  // forward
      auto layer = state.gather(l);
      activation[l + 1].assign(rows * layer.param(2 * l + 1).size(), 0.0f);
      model.forward_layer(l, layer.param(2 * l), layer.param(2 * l + 1), activation[l], activation[l + 1], rows);
    }
    std::vector<float> delta(activation.back().size());
    losses.push_back(model.output_loss(
        activation.back(), cohort_examples::rows_at(data.targets, indices, model.output_width()), rows, delta));
    forward.end();
    auto backward = timeline.span("backward");
    if (k == 0 && cfg.slowed(pg.rank(), step)) std::this_thread::sleep_for(std::chrono::milliseconds(cfg.slow_ms));
    for (std::size_t l = layers; l-- > 0;) {  // backward, last layer first
      auto layer = state.gather(l);
      std::vector<float> previous(l > 0 ? activation[l].size() : 0);
      model.backward_layer(l, layer.param(2 * l), activation[l], delta, state.gradient(2 * l),
                           state.gradient(2 * l + 1), previous, rows);
      state.mark_layer_ready(l);
      delta = std::move(previous);
    }
  };
  // With uneven inputs a rank out of batches keeps answering the others inside join().
  const bool joined = !cfg.batches_per_rank.empty();
  const auto started = std::chrono::steady_clock::now();
  std::optional<std::chrono::steady_clock::time_point> first_step_ended;
  int steps_after_first = 0;
  const auto loop = [&] {
    for (int step = first_step; step < cfg.batches_of(pg.rank()); ++step) {
      losses.clear();
      for (std::size_t k = 0; k < micro_steps; ++k) {
        if (k + 1 < micro_steps) {  // accumulated: reduced after the step's last micro-step
          auto accumulating = state.no_sync();
          micro_step(step, k);
        } else {
          micro_step(step, k);
        }
      }
      const auto result = state.step();
      if (first_step_ended)
        ++steps_after_first;
      else
        first_step_ended = std::chrono::steady_clock::now();
      // Inside a join no collective of the trainer's own: a joined rank is waiting in the
      // state's agreement. Rank 0's own loss is printed there instead of the mean.
      // --reproducible: every micro-batch's loss in the one order, the same bits at any world.
      const float shown = cfg.reproducible ? cohort::canonical_mean(pg, std::span<const float>(losses))
                          : joined         ? losses[0]
                                           : cohort::all_reduce_value(pg, losses[0], cohort::op::avg);
      if (prints && (step % 5 == 0 || step + 1 == cfg.batches_of(0)))
        std::printf("step %2d  loss %.6f%s  grad norm %.4f%s\n", step, shown, joined ? " (rank 0's)" : "",
                    result.grad_norm, result.clip_factor < 1 ? " (clipped)" : "");
      const bool stop = step == cfg.stop_after;
      const bool last = step + 1 == cfg.batches_of(pg.rank());
      if (!cfg.checkpoint.empty() && ((cfg.save_every > 0 && (step + 1) % cfg.save_every == 0) || stop || last))
        save(step, stop || last);
      if (stop) {
        stopped = true;
        break;
      }
      // A crash, not a stop: no save, no unwinding, the files as the kernel leaves them. Only in
      // a run that started from scratch, so that the relaunch with --resume runs past it.
      if (step == cfg.kill_at_step && first_step == 0 && pg.rank() == std::min(1, pg.world_size() - 1)) {
        std::printf("[rank %d] killed (SIGKILL) after step %d\n", pg.rank(), step);
        std::fflush(stdout);
        ::raise(SIGKILL);
      }
    }
  };
  if (joined)
    state.join(loop);
  else
    loop();
  const auto loop_ended = std::chrono::steady_clock::now();
  stragglers.flush();
  // Rank 0's verdict on the run: where the step went, and what these ranks deliver against one.
  if (const auto run = stragglers.run_summary()) {
    measured.verdict = cohort::scaling_verdict_of(*run);
    if (!quiet) std::printf("%s\n", cohort::format_scaling_verdict(*measured.verdict).c_str());
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  const auto memory = state.memory();
  if (!quiet) {
    std::printf("[rank %d] memory per rank: parameters %s, gradients %s, optimizer state %s\n", pg.rank(),
                cohort_examples::human(memory.parameters).c_str(), cohort_examples::human(memory.gradients).c_str(),
                cohort_examples::human(memory.optimizer_state).c_str());
    std::printf("[rank %d] wire bytes per step: %zu (%s, %zu buckets); %.2f ms per step\n", pg.rank(),
                state.wire_bytes_per_step(), cohort_examples::human(state.wire_bytes_per_step()).c_str(),
                state.bucket_count(), 1e3 * seconds / std::max(cfg.total_steps(), 1));
  }
  measured.ms_per_step = 1e3 * seconds / std::max(cfg.total_steps(), 1);
  measured.steady_ms_per_step =
      steps_after_first > 0
          ? 1e3 * std::chrono::duration<double>(loop_ended - *first_step_ended).count() / steps_after_first
          : measured.ms_per_step;
  std::fflush(stdout);
  measured.parameters_sha256 = cohort::parameter_sha256(state);  // collective: where the shards live
  return state.gather_parameters();
}

}  // namespace

int main(int argc, char** argv) try {
  const config cfg = cohort_examples::parse_train_options(argc, argv);
  const mlp model(cfg.widths);
  const auto layout = flat_layout::of(model);
  const auto data = cohort_examples::synthetic_data::make(cfg.batch * static_cast<std::size_t>(cfg.total_steps()),
                                                          model.input_width(), model.output_width(), 2024);
  int status = 0;
  // One run of the job: rank 0's measure. A quiet run is one of --compare-one-rank's later
  // rounds: it measures, and neither prints nor checks the result again.
  const auto run_job = [&](bool quiet) {
    run_measure measured;
    cohort::run_ranks(cfg.ranks, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
      if (cfg.batch % static_cast<std::size_t>(env.world_size) != 0)
        throw std::runtime_error("--batch must be divisible by the number of ranks");
      if (env.world_size % cfg.nodes != 0)
        throw std::runtime_error("--nodes " + std::to_string(cfg.nodes) + " does not divide " +
                                 std::to_string(env.world_size) + " ranks into equal groups");
      if (cfg.nodes > 1 && (!cfg.checkpoint.empty() || !cfg.batches_per_rank.empty()))
        throw std::runtime_error("--nodes with --checkpoint or --batches-per-rank: the state refuses replicas there");
      if (!cfg.batches_per_rank.empty() && cfg.batches_per_rank.size() != static_cast<std::size_t>(env.world_size))
        throw std::runtime_error("--batches-per-rank names " + std::to_string(cfg.batches_per_rank.size()) +
                                 " ranks for a world of " + std::to_string(env.world_size));
      cohort::process_group<cohort::gloo> pg{store, env};
      if (!cfg.checkpoint.empty() && !cfg.batches_per_rank.empty())
        throw std::runtime_error(
            "--checkpoint with --batches-per-rank: a save is collective, and a joined rank "
            "has no step to save at");
      bool stopped = false;
      run_measure here;
      const auto trained = train(stopped, here, pg, cfg, model, layout, data, {}, quiet);
      if (pg.rank() != 0) return;
      measured = here;
      if (quiet) return;
      cohort_examples::print_parameter_summary(trained);
      if (stopped) return;  // stopped as a job is: the comparison is for a finished run
      status = cohort_examples::report_against_single_process(cfg, model, layout, data, pg.world_size(), trained, 1e-5);
    });
    return measured;
  };
  const run_measure measured = run_job(false);
  // The verdict's estimate against measured runs of one rank on the same global batch, in A/B
  // rounds (N ranks, one rank, N ranks, ...). Another tenant's load only ever adds time, so each
  // side's fastest round is the closest to what this host delivers (as compile_time.py takes the
  // fastest run); the verdict's estimate of one rank's step comes from CPU time, which ranks
  // sharing cores and caches only inflate too: its least over the rounds. Both speedups divide
  // by the fastest N-rank step.
  // One rank's timeline goes to DIR/one-rank, beside the N ranks' files.
  if (cfg.compare_one_rank && cfg.ranks > 1 && measured.verdict && status == 0) {
    const char* timeline_root = std::getenv("COHORT_TIMELINE");
    const std::string one_rank_timeline =
        timeline_root && *timeline_root ? std::string(timeline_root) + "/one-rank" : std::string();
    std::vector<double> one_ms, many_ms, estimated_one_ms;
    for (int round = 0; round < cfg.compare_rounds; ++round) {
      const run_measure many = round == 0 ? measured : run_job(true);
      if (!many.verdict)
        throw std::runtime_error("a comparison round's run of " + std::to_string(cfg.ranks) +
                                 " ranks gave rank 0 no verdict");
      cohort::run_ranks(1, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
        cohort::process_group<cohort::gloo> pg{store, env};
        bool stopped = false;
        run_measure one;
        (void)train(stopped, one, pg, cfg, model, layout, data, one_rank_timeline, true);
        one_ms.push_back(one.steady_ms_per_step);
      });
      many_ms.push_back(many.steady_ms_per_step);
      estimated_one_ms.push_back(many.verdict->one_rank_step_ms);
      std::printf("round %d: %d ranks %.2f ms/step, one rank %.2f (estimated %.2f from the %d ranks' CPU time)\n",
                  round + 1, cfg.ranks, many_ms.back(), one_ms.back(), estimated_one_ms.back(), cfg.ranks);
    }
    const double fastest_many = *std::min_element(many_ms.begin(), many_ms.end());
    const double fastest_one = *std::min_element(one_ms.begin(), one_ms.end());
    const double estimated_one = *std::min_element(estimated_one_ms.begin(), estimated_one_ms.end());
    std::printf(
        "measured: %d ranks deliver %.2fx one rank's throughput (the fastest of %d A/B rounds, after the first "
        "step: one rank %.2f ms/step, %d ranks %.2f); the verdict estimated %.2fx (one rank %.2f ms/step, the "
        "rounds' least), %+.0f%% off\n",
        cfg.ranks, fastest_one / fastest_many, cfg.compare_rounds, fastest_one, cfg.ranks, fastest_many,
        estimated_one / fastest_many, estimated_one, 100 * (estimated_one - fastest_one) / fastest_one);
  }
  if (!measured.parameters_sha256.empty()) std::printf("parameters sha256 %s\n", measured.parameters_sha256.c_str());
  return status;
} catch (const std::exception& failure) {
  std::fprintf(stderr, "train: %s\n", failure.what());
  return 1;
}
