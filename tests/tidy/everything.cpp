// Not a test: the translation unit clang-tidy's bugprone checks read in CI (.ci/run). It
// includes every public header and instantiates each template the way a trainer does, on
// Gloo (host) and, for the parts a host compiler builds, on NCCL, so the checks see the
// code users compile rather than uninstantiated templates. It is never run. Thrust's CPP
// system stands in for the GPU so a host compiler reads the device sampler too.
#ifndef THRUST_DEVICE_SYSTEM
#define THRUST_DEVICE_SYSTEM THRUST_DEVICE_SYSTEM_CPP
#endif
#include <cohort/cohort.hpp>
#include <cohort/data/sampler_thrust.hpp>
#include <cohort/diagnostics/trace.hpp>
#include <cohort/tools/planner.hpp>
#include <cohort/tools/topology.hpp>

#include <cstdio>
#include <exception>
#include <filesystem>
#include <memory>
#include <ostream>
#include <span>
#include <vector>

namespace {

template <class B>
void collectives(cohort::process_group<B>& pg) {
  std::vector<float> in(8 * static_cast<std::size_t>(pg.size())), out(in.size()), one(8);
  pg.all_reduce(std::span<float>(in), cohort::op::avg).wait();
  pg.all_reduce(std::span<const float>(in), std::span<float>(out)).wait();
  pg.reduce_scatter(std::span<const float>(in), std::span<float>(one)).wait();
  pg.all_gather(std::span<const float>(one), std::span<float>(out)).wait();
  pg.all_to_all(std::span<const float>(in), std::span<float>(out)).wait();
  pg.broadcast(std::span<float>(one), 0).wait();
  pg.barrier().wait();
  if (pg.size() > 1) {
    auto sent = pg.send(std::span<const float>(one), (pg.rank() + 1) % pg.size(), 3);
    pg.recv(std::span<float>(one), (pg.rank() + pg.size() - 1) % pg.size(), 3).wait();
    sent.wait();
  }
  if (auto sub = pg.split(pg.rank() % 2, pg.rank())) sub->barrier().wait();
  // Any contiguous range, the caller's stream, host values.
  pg.all_reduce(in).wait();
  pg.all_gather(one, out).wait();
  pg.on(pg.backend().stream()).all_reduce(std::span<float>(in), cohort::op::avg).wait();
  (void)cohort::all_reduce_value(pg, 1.0f, cohort::op::avg);
  (void)cohort::all_reduce_values(pg, {1.0, 2.0});
  const std::vector<float> losses{0.5f, 0.25f};
  (void)cohort::canonical_mean(pg, std::span<const float>(losses));
}

void host_training(std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
  cohort::process_group<cohort::gloo> pg{store, env};
  collectives(pg);

  // Data parallelism: the training state under ddp, accumulation.
  {
    const std::vector<cohort::region> regions{{"w", 0, 300, 0}, {"b", 300, 20, 1, false}};
    cohort::training_state<cohort::gloo> ddp{pg, regions, {.max_grad_norm = 1.0}};
    ddp.load_parameters(std::vector<float>(320));
    {
      auto scope = ddp.no_sync();
      for (std::size_t r = regions.size(); r-- > 0;) ddp.mark_ready(r);
    }
    for (std::size_t r = regions.size(); r-- > 0;) ddp.mark_ready(r);
    (void)ddp.step();
  }

  // The trainer's own buffers and optimizer, adopted; uneven inputs; evaluation passes.
  {
    const std::vector<cohort::region> regions{{"w", 0, 300, 0}, {"b", 300, 20, 1, false}};
    std::vector<float> params(320, 1.0f), grads(320);
    cohort::training_state<cohort::gloo> adopted{pg,
                                                 std::span(params),
                                                 std::span(grads),
                                                 regions,
                                                 {.strategy = cohort::strategy::zero1, .trainer_optimizer = true}};
    adopted.join([&] {
      for (std::size_t l = 2; l-- > 0;) adopted.mark_layer_ready(l);
      const auto result = adopted.step();
      for (const auto& s : adopted.owned_spans())
        for (std::size_t i = 0; i < s.parameters.size(); ++i) s.parameters[i] -= 0.1f * s.gradients[i];
      (void)result;
      adopted.publish_parameters();
    });
    auto evaluating = adopted.evaluation();
    (void)adopted.gather(1).param(1);
  }

  // Hybrid sharding (a copy per replica group), checkpoints of it.
  const auto directory = std::filesystem::temp_directory_path() / "cohort-tidy";
  {
    auto shards = pg.split(0, pg.rank());
    auto replicas = pg.split(pg.rank(), 0);
    const std::vector<cohort::region> regions{{"w", 0, 8, 0}, {"b", 8, 4, 1, false}};
    cohort::training_state<cohort::gloo> hybrid{*shards, regions, {.strategy = cohort::strategy::zero3}, &*replicas};
    hybrid.load_parameters(std::vector<float>(12, 1.0f));
    {
      auto layer = hybrid.gather(0);
      (void)layer.param(0);
    }
    const auto saved = cohort::save_checkpoint(hybrid, directory.string(), 1);
    (void)cohort::load_checkpoint(hybrid, saved.path);
    (void)cohort::resume_checkpoint(hybrid, directory.string(), {.fall_back = false});
    (void)cohort::verify_checkpoint(saved.path);
    (void)cohort::parameter_sha256(hybrid);
    (void)cohort::checkpoint_parameter_sha256(saved.path);
  }

  // Flat buffers: a training state with a loss scaler.
  {
    cohort::loss_scaler scaler;
    // One training state: every strategy, bf16 parameters with fp32 masters, SGD too.
    for (const auto kind : {cohort::strategy::ddp, cohort::strategy::zero2, cohort::strategy::zero3}) {
      const std::vector<cohort::region> layers{{"w", 0, 40, 0}, {"b", 40, 24, 1, false}};
      cohort::training_state<cohort::gloo, cohort::bfloat16, float> state{
          pg, layers, {.strategy = kind, .sgd = cohort::sgd_options{.momentum = 0.9}, .scaler = &scaler}};
      state.load_parameters(std::vector<cohort::bfloat16>(64, cohort::bfloat16(1.0f)));
      for (std::size_t l = 2; l-- > 0;) {
        auto layer = state.gather(l);
        (void)layer.param(l);
        (void)state.gradient(l);
        state.mark_layer_ready(l);
      }
      (void)state.step();
      (void)state.gather_parameters();
    }
  }

  // Straggler report: on a training state and on zero3 gathers, a counted wait, the last window.
  cohort::straggler_report stragglers{pg, {.every = 2, .output = nullptr}};
  {
    cohort::training_state<cohort::gloo> timed{pg, {{"w", 0, 8}}, {.straggler = &stragglers}};
    cohort::training_state<cohort::gloo> timed_zero3{
        pg, {{"w", 0, 8}}, {.strategy = cohort::strategy::zero3, .straggler = &stragglers}};
    for (int step = 0; step < 3; ++step) {
      timed.mark_ready(0);
      (void)timed.step();
      (void)timed_zero3.gather(0).param(0);
    }
    stragglers.wait(pg.barrier());
  }
  stragglers.flush();

  // Sampler, batch bookkeeping, guards.
  cohort::distributed_sampler sampler{100, pg, {.shuffle = true, .seed = 0}};
  sampler.set_epoch(1);
  for (auto index : sampler) (void)index;
  (void)cohort::device_indices(sampler);
  cohort::distributed_sampler micro_batches{100, pg, {.micro_batches = 8, .micro_batch_size = 3}};
  for (const auto& batch : cohort::batch_sequence{micro_batches, 3, 8 / pg.world_size()}) (void)batch;
  const auto plan = cohort::launch_plan(cohort::batch_plan{.per_device = 2, .accumulation = 8, .world = 2}, pg);
  (void)plan.effective();
  (void)cohort::launch_plan(cohort::global_batch{.size = 32, .accumulation = 8}, pg);
  (void)cohort::suggest_loader_workers(16, pg.local_size());
  cohort::main_process_first(pg, [] {});
  cohort::local_main_process_first(pg, [] {});
  (void)cohort::on_main(pg, [] { return 1; });
  cohort::atomic_write_on_main(pg, directory / "file", [](std::ostream& out) { out << "x"; });
  cohort::rank_logger log(pg);
  log("done");
  cohort::main_printf(pg, "done %d\n", 1);
  cohort::printf_on(pg, 1, "done %s\n", "too");
  cohort::rank_printf(env, "done\n");
}

#if defined(COHORT_HAS_NCCL) && COHORT_HAS_NCCL
void device_group(std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
  cohort::process_group<cohort::nccl> pg{store, env};
  collectives(pg);
}
#endif

}  // namespace

int main() {
  try {
    cohort::run_ranks(2, host_training);
    cohort::run_ranks(0, host_training);
#if defined(COHORT_HAS_NCCL) && COHORT_HAS_NCCL
    cohort::run_ranks(1, device_group);
#endif
    const auto topology = cohort::probe_topology();
    (void)topology;
    (void)cohort::plan(cohort::plan_input{});
    (void)cohort::format_trace_report(cohort::analyze_traces(std::filesystem::temp_directory_path()));
  } catch (const std::exception& failure) {
    std::fprintf(stderr, "%s\n", failure.what());
    return 1;
  }
  return 0;
}
