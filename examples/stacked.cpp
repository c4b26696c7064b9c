// A hand-written trainer, converted: stacked_model.hpp is a model kept as llm.c keeps GPT-2's
// (one flat buffer, each block tensor stacked over the blocks, reached by pointer arithmetic;
// its own AdamW), stacked_plain.hpp its trainer without cohort, and stacked_cohort.hpp the same
// trainer converted to cohort with its buffers, pointers, forward, backward and update
// unchanged (`diff examples/stacked_plain.hpp examples/stacked_cohort.hpp`). At zero3 the
// parameters are sharded, so the forward and backward read them through the state's views
// (train_zero3 below).
//
//   stacked --ranks 4 --strategy zero2                      # the trainer's own AdamW
//   stacked --ranks 4 --strategy zero2 --optimizer cohort   # or the state's
//   mpirun -np 2 stacked --strategy ddp                     # or torchrun --no-python, srun
//
// Rank 0 ends with the final loss against the trainer without cohort on the whole batch and,
// with the trainer's own optimizer, whether one rank is bit-identical to it.
#include <cohort/cohort.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "command_line.hpp"
#include "stacked_cohort.hpp"
#include "stacked_plain.hpp"

namespace {

using namespace cohort_examples::stacked;

// zero3: the parameters are sharded, so the forward and backward read each layer through the
// state's view (all-gathered on use, released after); the gradients still go to the
// trainer's buffer, by its own pointers.
std::vector<float> train_zero3(cohort::process_group<cohort::gloo>& pg, const shape& s, const dataset& data,
                               const run& r, float& loss, const cohort::training_options& options) {
  std::vector<float> params(parameter_count(s)), grads(params.size()), m(params.size()), v(params.size());
  initialize(s, params.data(), 2024);
  const tensors g = point(s, grads.data());
  cohort::training_state<cohort::gloo> state(pg, std::span(params), std::span(grads), regions(s),
                                             {.strategy = cohort::strategy::zero3,
                                              .adam = {.lr = r.adam.lr,
                                                       .beta1 = r.adam.beta1,
                                                       .beta2 = r.adam.beta2,
                                                       .eps = r.adam.eps,
                                                       .weight_decay = r.adam.weight_decay},
                                              .trainer_optimizer = options.trainer_optimizer,
                                              .max_grad_norm = r.max_grad_norm});
  // Region indices (regions(s)): the input layer's, each block's, the output layer's.
  const std::size_t blocks = s.blocks, out_w = 2 + 2 * blocks, out_b = out_w + 1;
  const auto w = [&](const auto& view, std::size_t region) { return view.param(region).data(); };
  const std::size_t batch = r.batch / static_cast<std::size_t>(pg.world_size());
  const std::size_t first = batch * static_cast<std::size_t>(pg.rank());
  activations a(s, batch);
  for (int step = 0; step < r.steps; ++step) {
    const float* x = data.inputs(step, first);
    std::fill(grads.begin(), grads.end(), 0.0f);
    if (auto in = state.gather(0); true) forward_input(s, w(in, 0), w(in, 1), x, batch, a);
    for (std::size_t l = 0; l < blocks; ++l) {
      auto block = state.gather(l + 1);
      forward_block(s, l, w(block, 2 + l), w(block, 2 + blocks + l), batch, a);
    }
    if (auto out = state.gather(blocks + 1); true)
      loss = forward_output(s, w(out, out_w), w(out, out_b), data.targets(step, first), batch, a);
    // The backward gathers each layer again, top down: the layers it has passed are reduced
    // while it goes on.
    if (auto out = state.gather(blocks + 1); true) backward_output(s, w(out, out_w), g.out_w, g.out_b, batch, a);
    state.mark_layer_ready(blocks + 1);
    for (std::size_t l = blocks; l-- > 0;) {
      auto block = state.gather(l + 1);
      backward_block(s, l, w(block, 2 + l), g.block_w + l * s.width * s.width, g.block_b + l * s.width, batch, a);
      state.mark_layer_ready(l + 1);
    }
    (void)state.gather(0);  // the input layer's backward reads no parameter, but is the backward's
    backward_input(s, x, g.in_w, g.in_b, batch, a);
    const auto result = state.step();
    if (!*options.trainer_optimizer) continue;
    if (!result.skipped)
      for (const auto& o : state.owned_spans())
        adamw(o.parameters.data(), o.gradients.data(), &m[o.owned], &v[o.owned], o.parameters.size(), step + 1, r.adam,
              result.gradient_scale);
    state.publish_parameters();
  }
  loss = cohort::all_reduce_value(pg, loss, cohort::op::avg);
  return state.gather_parameters();
}

std::vector<float> train(cohort::process_group<cohort::gloo>& pg, const shape& s, const dataset& data, const run& r,
                         float& loss, const cohort::training_options& options) {
  if (r.batch % static_cast<std::size_t>(pg.world_size()) != 0)
    throw std::runtime_error("the batch of " + std::to_string(r.batch) + " rows does not divide by " +
                             std::to_string(pg.world_size()) + " ranks");
  return options.strategy == cohort::strategy::zero3 ? train_zero3(pg, s, data, r, loss, options)
                                                     : train_cohort(pg, s, data, r, loss, options);
}

}  // namespace

int main(int argc, char** argv) try {
  int ranks = 0;  // 0: read the launcher's environment
  run r;
  // The state's settings: the trainer's AdamW by default; with --optimizer cohort, the
  // state's AdamW with the same settings.
  cohort::training_options options{.adam = {r.adam.lr, r.adam.beta1, r.adam.beta2, r.adam.eps, r.adam.weight_decay},
                                   .trainer_optimizer = true,
                                   .max_grad_norm = r.max_grad_norm};
  for (cohort_examples::command_line args(argc, argv); args.next();) {
    if (args.is("--ranks")) {
      ranks = std::stoi(args.value());
    } else if (args.is("--steps")) {
      r.steps = std::stoi(args.value());
    } else if (args.is("--strategy")) {
      const auto parsed = cohort::parse_strategy(args.value());
      if (!parsed) throw std::runtime_error("--strategy takes ddp, zero1, zero2 or zero3");
      options.strategy = *parsed;
    } else if (args.is("--optimizer")) {
      const std::string who = args.value();
      if (who != "own" && who != "cohort") throw std::runtime_error("--optimizer takes own or cohort");
      options.trainer_optimizer = who == "own";
    } else {
      args.usage(
          "usage: stacked [--ranks N] [--strategy ddp|zero1|zero2|zero3] [--optimizer own|cohort] [--steps N]\n");
    }
  }
  const shape s;
  const dataset data(s, r.batch, r.steps);
  std::vector<float> trained;
  float loss = 0;
  int world = 0;
  cohort::run_ranks(ranks, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
    cohort::process_group<cohort::gloo> pg{store, env};
    float mine = 0;
    auto params = train(pg, s, data, r, mine, options);
    if (pg.rank() != 0) return;
    trained = std::move(params);
    loss = mine;
    world = pg.world_size();
  });
  if (trained.empty()) return 0;  // not rank 0: rank 0 reports
  float reference_loss = 0;
  const auto reference = train_plain(s, data, r, reference_loss);
  double worst = 0;
  for (std::size_t i = 0; i < reference.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(trained[i]) - reference[i]));
  const bool match = worst < 1e-4 && std::abs(loss - reference_loss) < 1e-5;
  std::printf("trained %zu parameters at %d rank(s), %s, %s optimizer; max |parameter difference| %.2e\n",
              reference.size(), world, std::string(cohort::to_string(options.strategy)).c_str(),
              *options.trainer_optimizer ? "the trainer's own" : "cohort's", worst);
  std::printf("final loss: %s %.9f, single process %.9f, |difference| %.2e: %s\n",
              std::string(cohort::to_string(options.strategy)).c_str(), loss, reference_loss,
              std::abs(loss - reference_loss), match ? "match" : "MISMATCH");
  if (!*options.trainer_optimizer) return match ? 0 : 1;
  // One rank with the trainer's own optimizer must be the trainer without cohort, bit for bit.
  std::vector<float> alone;
  cohort::run_thread_ranks(1, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
    cohort::process_group<cohort::gloo> pg{store, env};
    float ignored = 0;
    alone = train(pg, s, data, r, ignored, options);
  });
  const bool identical = std::memcmp(alone.data(), reference.data(), reference.size() * sizeof(float)) == 0;
  double differs = 0;
  for (std::size_t i = 0; i < reference.size(); ++i)
    differs = std::max(differs, std::abs(static_cast<double>(alone[i]) - reference[i]));
  if (identical)
    std::printf("own optimizer at 1 rank: bit-identical to the trainer without cohort\n");
  else
    std::printf("own optimizer at 1 rank: differs by %.3e from the trainer without cohort\n", differs);
  return match && identical ? 0 : 1;
} catch (const std::exception& failure) {
  std::fprintf(stderr, "stacked: %s\n", failure.what());
  return 1;
}
