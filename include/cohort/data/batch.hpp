#pragma once
// The effective-batch planner and the per-device batch sequence.
//
//   batch_plan{.per_device = 2, .accumulation = 8, .world = 1}.effective()  == 16
//   ... .rescaled_for(4)                        -> {2, 2, 4}: same effective batch
//   ... .rescaled_for(4, keep::accumulation)    -> {2, 8, 4}, learning rate x4 (linear rule)
//   launch_plan(plan, pg)                       -> throws unless pg.world_size() == plan.world or
//                                                  the change is acknowledged; rank 0 prints a summary
//   global_batch{.size = 512, .accumulation = 2}.plan_for(4)
//                                               -> {64, 2, 4}: per_device = size / (world x accumulation)
//   launch_plan(global_batch{...}, pg)          -> the same on pg.world_size() ranks, checked to be
//                                                  the same configuration on every rank; rank 0
//                                                  prints a summary
//   batch_sequence{sampler, plan}               -> this rank's micro-batches, each saying which
//                                                  optimizer step it belongs to and whether it syncs
//   suggest_loader_workers(cores, local_ranks)  -> data-loader workers per rank

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cohort/comm/host_values.hpp"
#include "cohort/config.hpp"
#include "cohort/data/sampler.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0 {

// What rescaled_for keeps constant when the world size changes.
enum class keep {
  effective_batch,  // divide accumulation; the learning rate stays
  accumulation,     // the effective batch changes; the learning rate follows the linear rule
};

struct batch_plan {
  int per_device = 1;
  int accumulation = 1;
  int world = 1;
  double learning_rate = 0.0;  // 0: not tracked
  // Advice attached by rescaled_for (for example the warm-up reminder); empty otherwise.
  std::string note = {};

  std::int64_t effective() const noexcept { return std::int64_t{per_device} * accumulation * world; }

  // The plan for `new_world` ranks. keep::effective_batch throws when accumulation * world is
  // not a multiple of new_world, naming the nearest world sizes that would work.
  COHORT_DECL batch_plan rescaled_for(int new_world, keep what = keep::effective_batch) const;

  // "per-device batch 2 x accumulation 8 x world 4 = effective batch 64, learning rate 0.1"
  COHORT_DECL std::string summary() const;

  COHORT_DECL void validate(const char* operation) const;

 private:
  COHORT_DECL static std::string nearest_worlds_hint(std::int64_t micro_batches, int new_world);
};

// A run configured by its global batch: the samples of one optimizer step over all ranks
// (the effective batch). The per-device batch follows from the world it runs on:
// per_device = size / (world x accumulation).
struct global_batch {
  std::int64_t size = 0;
  int accumulation = 1;
  double learning_rate = 0.0;  // 0: not tracked

  // The plan on `world` ranks (effective() == size). Throws when size is not a multiple of
  // world x accumulation, naming the numbers, the nearest global batches that split and, when
  // the world divides the global batch, the nearest accumulations that would.
  COHORT_DECL batch_plan plan_for(int world) const;
};

namespace detail {
// cohort's own groups compare the ranks' numbers (through comm/host_values.hpp, included
// above, so the check cannot turn off for want of an include); any other type with rank()
// and world_size() (a trainer's own group, a test's) plans from its own numbers alone.
template <class G>
inline constexpr bool is_process_group = false;
template <backend B>
inline constexpr bool is_process_group<process_group<B>> = true;
// Throws on every rank when the ranks' configurations differ: `extremes` holds the maxima of
// size, accumulation, learning rate and of their negations.
COHORT_DECL void check_same_global_batch(const global_batch& mine, const std::vector<double>& extremes, int rank);
}  // namespace detail

// How launch_plan treats a world size different from the configured one.
enum class world_change {
  refuse,                // throw: the run was configured for another world size
  keep_effective_batch,  // acknowledged: rescaled_for(size, keep::effective_batch)
  keep_accumulation,     // acknowledged: rescaled_for(size, keep::accumulation)
};

// Checks the configured plan against the group it was launched on, then has rank 0 print one
// summary line ("cohort: per-device batch ... = effective batch ..."). Every rank gets the
// same plan back (or the same error), so no rank trains with a different batch.
template <class Group>
  requires requires(Group& group) {
    { group.rank() } -> std::convertible_to<int>;
    { group.world_size() } -> std::convertible_to<int>;
  }
batch_plan launch_plan(const batch_plan& configured, Group& group, world_change on_change = world_change::refuse,
                       std::ostream& summary_out = std::clog) {
  const int rank = static_cast<int>(group.rank());
  const int size = static_cast<int>(group.world_size());
  configured.validate("launch_plan");
  batch_plan plan = configured;
  if (size != configured.world) {
    if (on_change == world_change::refuse)
      throw error(rank, "launch_plan",
                  detail::text("the run was configured for world size ", std::to_string(configured.world), " (",
                               configured.summary(), ") but launched on ", std::to_string(size), " ranks"),
                  detail::text("launch with ", std::to_string(configured.world),
                               " ranks, or acknowledge the change with world_change::keep_effective_batch or "
                               "world_change::keep_accumulation"));
    plan = configured.rescaled_for(
        size, on_change == world_change::keep_effective_batch ? keep::effective_batch : keep::accumulation);
  }
  if (rank == 0) {
    std::string line = detail::text("cohort: ", plan.summary());
    if (size != configured.world) line += detail::text(" (rescaled from world ", std::to_string(configured.world), ")");
    if (!plan.note.empty()) line += detail::text("; ", plan.note);
    line += '\n';
    summary_out << line << std::flush;
  }
  return plan;
}

// The plan for a configured global batch on the group it was launched on, every rank the
// same: with a process_group the ranks first compare their configurations (one all-reduce of
// a few numbers) and, when any differs, every rank throws, naming its own and the range
// across ranks, instead of some training with another per-device batch. Rank 0 then prints
// one summary line ("cohort: per-device batch 64 x accumulation 2 x world 4 = effective batch
// 512 (from global batch 512)"). Collective on a process_group: every rank calls it.
template <class Group>
  requires requires(Group& group) {
    { group.rank() } -> std::convertible_to<int>;
    { group.world_size() } -> std::convertible_to<int>;
  }
batch_plan launch_plan(const global_batch& configured, Group& group, std::ostream& summary_out = std::clog) {
  const int rank = static_cast<int>(group.rank());
  const int size = static_cast<int>(group.world_size());
  if constexpr (detail::is_process_group<Group>) {
    // Before any local check, so a rank that would refuse its own numbers does not leave
    // the others waiting here: max of each number and of its negation (its minimum).
    const std::vector<double> mine{static_cast<double>(configured.size),
                                   static_cast<double>(configured.accumulation),
                                   configured.learning_rate,
                                   -static_cast<double>(configured.size),
                                   -static_cast<double>(configured.accumulation),
                                   -configured.learning_rate};
    const std::vector<double> extremes = cohort::all_reduce_values(group, mine, op::max);
    detail::check_same_global_batch(configured, extremes, rank);
  }
  const batch_plan plan = configured.plan_for(size);
  if (rank == 0)
    summary_out << (detail::text("cohort: ", plan.summary(), " (from global batch ", std::to_string(configured.size),
                                 ")\n"))
                << std::flush;
  return plan;
}

// Data-loader workers per rank: each rank's training process keeps one core, the rest are
// shared evenly among the ranks on the node. `requested_per_rank` >= 0 checks a chosen value
// instead of suggesting one.
struct loader_workers {
  int per_rank = 0;
  int total = 0;  // workers on the node, all local ranks together
  int cores = 0;
  std::string warning;  // non-empty when workers + training processes exceed the cores
};

COHORT_DECL loader_workers suggest_loader_workers(int cores, int local_ranks, int requested_per_rank = -1,
                                                  const warning_sink& warn = {});

COHORT_DECL loader_workers suggest_loader_workers_for_this_machine(int local_ranks, int requested_per_rank = -1,
                                                                   const warning_sink& warn = {});

// ---- per-device batches, aware of gradient accumulation -----------------------------------

// What to do with a last micro-batch shorter than per_device.
enum class partial_batch {
  keep,  // yield it short (is_partial() true)
  drop,  // leave those indices out of this epoch
};

struct micro_batch {
  std::vector<std::uint64_t> indices;
  std::size_t batch = 0;       // position among this rank's micro-batches in the epoch
  std::size_t step = 0;        // optimizer step it belongs to
  int micro_step = 0;          // 0 .. micro_steps - 1 within that step
  int micro_steps = 1;         // micro-batches in that step: accumulation, or fewer in a short last step
  bool sync = true;            // last micro-step of its step: reduce gradients and step the optimizer
  std::size_t per_device = 0;  // the planned size (indices.size() is smaller for a partial batch)

  bool is_partial() const noexcept { return indices.size() < per_device; }
};

// This rank's micro-batches for the sampler's current epoch. Micro-batch b holds sampler
// positions [b * per_device, (b + 1) * per_device); consecutive groups of `accumulation`
// micro-batches form an optimizer step. When the batch count is not a multiple of
// accumulation, the last step is shorter: micro_steps says how many micro-batches it has (divide
// the loss by it) and its last micro-batch still syncs, so no gradient is left unreduced.
// The sampler gives every rank the same number of indices, so every rank sees the same steps
// and syncs at the same micro-batches (a rank that synced alone would hang the others).
class batch_sequence {
 public:
  COHORT_DECL batch_sequence(distributed_sampler& sampler, int per_device, int accumulation = 1,
                             partial_batch partial = partial_batch::keep);
  COHORT_DECL batch_sequence(distributed_sampler& sampler, const batch_plan& plan,
                             partial_batch partial = partial_batch::keep);

  // Micro-batches this rank yields in the epoch.
  COHORT_DECL std::size_t size() const noexcept;
  // Optimizer steps in the epoch (the last may be short).
  COHORT_DECL std::size_t steps() const noexcept;

  COHORT_DECL micro_batch operator[](std::size_t b) const;

  class iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = micro_batch;
    using difference_type = std::ptrdiff_t;
    using reference = micro_batch;
    using pointer = void;

    iterator() = default;
    iterator(const batch_sequence* sequence, std::size_t position) : sequence_(sequence), position_(position) {}
    micro_batch operator*() const { return (*sequence_)[position_]; }
    iterator& operator++() noexcept {
      ++position_;
      return *this;
    }
    iterator operator++(int) noexcept {
      iterator before = *this;
      ++position_;
      return before;
    }
    friend bool operator==(const iterator& a, const iterator& b) noexcept { return a.position_ == b.position_; }

   private:
    const batch_sequence* sequence_ = nullptr;
    std::size_t position_ = 0;
  };

  // Starting the iteration counts as a pass over the sampler's epoch (see set_epoch warning).
  COHORT_DECL iterator begin();
  iterator end() const { return iterator(this, size()); }

 private:
  distributed_sampler* sampler_;
  int per_device_;
  int accumulation_;
  partial_batch partial_;
};

}  // namespace cohort::inline v0

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/data/impl/batch.ipp"
#endif
