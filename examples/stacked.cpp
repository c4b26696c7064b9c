// A hand-written trainer, converted: stacked_model.hpp is a model kept as llm.c keeps GPT-2's
// (one flat buffer, each block tensor stacked over the blocks, reached by pointer arithmetic;
// its own AdamW), stacked_plain.hpp its trainer without cohort, and stacked_cohort.hpp the same
// trainer converted to cohort with its buffers, pointers, forward, backward and update
// unchanged (`diff examples/stacked_plain.hpp examples/stacked_cohort.hpp`), under every
// strategy: at zero3 each gather lands the layer in the trainer's own buffer.
//
//   stacked --ranks 4 --strategy zero2                      # the trainer's own AdamW
//   stacked --ranks 4 --strategy zero2 --optimizer cohort   # or the state's
//   mpirun -np 2 stacked --strategy ddp                     # or torchrun --no-python, srun
//   stacked --ranks 4 --reproducible --micro-batches 8      # the same bits at any world size
//
// Rank 0 ends with the final loss against the trainer without cohort on the whole batch, with
// the trainer's own optimizer whether one rank is bit-identical to it (not with --reproducible,
// whose sum over micro-batches takes the canonical order, not the trainer's), and the
// parameters' digest (cohort::parameter_sha256), the same at any world size with --reproducible.
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

std::vector<float> train(cohort::process_group<cohort::gloo>& pg, const shape& s, const dataset& data, const run& r,
                         float& loss, const cohort::training_options& options, std::string& digest) {
  if (r.batch % static_cast<std::size_t>(pg.world_size()) != 0)
    throw std::runtime_error("the batch of " + std::to_string(r.batch) + " rows does not divide by " +
                             std::to_string(pg.world_size()) + " ranks");
  return train_cohort(pg, s, data, r, loss, options, digest);
}

}  // namespace

int main(int argc, char** argv) try {
  int ranks = 0;  // 0: read the launcher's environment
  run r;
  bool reproducible = false;
  std::size_t micro_batches = 0;  // 0: 8 with --reproducible
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
    } else if (args.is("--reproducible")) {
      reproducible = true;
    } else if (args.is("--micro-batches")) {
      micro_batches = std::stoul(args.value());
    } else {
      args.usage(
          "usage: stacked [--ranks N] [--strategy ddp|zero1|zero2|zero3] [--optimizer own|cohort] [--steps N]\n"
          "               [--reproducible [--micro-batches K]]   (bit-identical parameters at any world size: K\n"
          "                micro-batches a step, default 8, each rank a run of K / N of them)\n");
    }
  }
  if (micro_batches != 0 && !reproducible)
    throw std::runtime_error("--micro-batches: with --reproducible (the micro-steps of its fixed order)");
  if (reproducible) {
    r.micro_batches = micro_batches ? micro_batches : 8;
    if (r.batch % r.micro_batches != 0)
      throw std::runtime_error("--micro-batches " + std::to_string(r.micro_batches) + ": the batch of " +
                               std::to_string(r.batch) + " rows must split into that many");
    options.reproducible = cohort::reproducible_options{r.micro_batches, r.batch / r.micro_batches};
  }
  const shape s;
  const dataset data(s, r.batch, r.steps);
  std::vector<float> trained;
  float loss = 0;
  int world = 0;
  std::string digest;
  cohort::run_ranks(ranks, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
    cohort::process_group<cohort::gloo> pg{store, env};
    float mine = 0;
    std::string mine_digest;
    auto params = train(pg, s, data, r, mine, options, mine_digest);
    if (pg.rank() != 0) return;
    trained = std::move(params);
    digest = mine_digest;
    loss = mine;
    world = pg.world_size();
  });
  if (trained.empty()) return 0;  // not rank 0: rank 0 reports
  float reference_loss = 0;
  const auto reference = train_plain(s, data, r, reference_loss);
  // One rank with the trainer's own optimizer must be the trainer without cohort, bit for bit
  // (trained before the report, whose lines its samples would otherwise split).
  std::vector<float> alone;
  if (*options.trainer_optimizer && !reproducible)
    cohort::run_thread_ranks(1, [&](std::shared_ptr<cohort::store> store, const cohort::launch_env& env) {
      cohort::process_group<cohort::gloo> pg{store, env};
      float ignored = 0;
      std::string ignored_digest;
      alone = train(pg, s, data, r, ignored, options, ignored_digest);
    });
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
  const auto digest_line = [&] { std::printf("parameters sha256 %s\n", digest.c_str()); };
  if (!*options.trainer_optimizer || reproducible) {
    digest_line();
    return match ? 0 : 1;
  }
  const bool identical = std::memcmp(alone.data(), reference.data(), reference.size() * sizeof(float)) == 0;
  double differs = 0;
  for (std::size_t i = 0; i < reference.size(); ++i)
    differs = std::max(differs, std::abs(static_cast<double>(alone[i]) - reference[i]));
  if (identical)
    std::printf("own optimizer at 1 rank: bit-identical to the trainer without cohort\n");
  else
    std::printf("own optimizer at 1 rank: differs by %.3e from the trainer without cohort\n", differs);
  digest_line();
  return match && identical ? 0 : 1;
} catch (const std::exception& failure) {
  std::fprintf(stderr, "stacked: %s\n", failure.what());
  return 1;
}
