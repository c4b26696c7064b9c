#pragma once
// The effective-batch planner and the per-device batch sequence.
//
//   batch_plan{.per_device = 2, .accumulation = 8, .world = 1}.effective()  == 16
//   ... .rescaled_for(4)                        -> {2, 2, 4}: same effective batch
//   ... .rescaled_for(4, keep::accumulation)    -> {2, 8, 4}, learning rate x4 (linear rule)
//   launch_plan(plan, pg)                       -> throws unless pg.size() == plan.world or the
//                                                  change is acknowledged; rank 0 prints a summary
//   batch_sequence{sampler, plan}               -> this rank's micro-batches, each saying which
//                                                  optimizer step it belongs to and whether it syncs
//   suggest_loader_workers(cores, local_ranks)  -> data-loader workers per rank

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cohort/error.hpp"
#include "cohort/sampler.hpp"

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
  batch_plan rescaled_for(int new_world, keep what = keep::effective_batch) const {
    validate("batch_plan::rescaled_for");
    if (new_world < 1)
      throw error(-1, "batch_plan::rescaled_for",
                  "new world size must be at least 1, got " + std::to_string(new_world));
    batch_plan result = *this;
    result.world = new_world;
    result.note.clear();
    if (what == keep::effective_batch) {
      const std::int64_t micro_batches = std::int64_t{accumulation} * world;  // per step, all ranks
      if (micro_batches % new_world != 0) {
        throw error(-1, "batch_plan::rescaled_for",
                    "cannot keep effective batch " + std::to_string(effective()) + " (per_device " +
                        std::to_string(per_device) + " x accumulation " + std::to_string(accumulation) + " x world " +
                        std::to_string(world) + ") on world " + std::to_string(new_world) + ": accumulation would be " +
                        std::to_string(micro_batches) + "/" + std::to_string(new_world) + ", not a whole number",
                    nearest_worlds_hint(micro_batches, new_world));
      }
      result.accumulation = static_cast<int>(micro_batches / new_world);
      return result;
    }
    // keep::accumulation: the effective batch scales with the world, and so does the learning
    // rate under the linear scaling rule (Goyal et al., 2017).
    const double factor = static_cast<double>(new_world) / static_cast<double>(world);
    result.learning_rate = learning_rate * factor;
    std::ostringstream note;
    note << "effective batch " << effective() << " -> " << result.effective();
    if (learning_rate != 0.0) note << ", learning rate " << learning_rate << " -> " << result.learning_rate;
    note << " (linear scaling rule, x" << factor << ")";
    if (factor > 1.0)
      note << "; warm the learning rate up over the first steps (e.g. a linear warm-up of a few "
              "epochs): a large jump at step 0 often diverges";
    result.note = note.str();
    return result;
  }

  // "per-device batch 2 x accumulation 8 x world 4 = effective batch 64, learning rate 0.1"
  std::string summary() const {
    std::ostringstream line;
    line << "per-device batch " << per_device << " x accumulation " << accumulation << " x world " << world
         << " = effective batch " << effective();
    if (learning_rate != 0.0) line << ", learning rate " << learning_rate;
    return line.str();
  }

  void validate(const char* operation) const {
    if (per_device < 1 || accumulation < 1 || world < 1)
      throw error(-1, operation,
                  "per_device, accumulation and world must all be at least 1, got " + std::to_string(per_device) +
                      ", " + std::to_string(accumulation) + ", " + std::to_string(world));
  }

 private:
  static std::string nearest_worlds_hint(std::int64_t micro_batches, int new_world) {
    std::int64_t below = 0, above = 0;
    for (std::int64_t w = new_world - 1; w >= 1; --w)
      if (micro_batches % w == 0) {
        below = w;
        break;
      }
    for (std::int64_t w = new_world + 1; w <= micro_batches; ++w)
      if (micro_batches % w == 0) {
        above = w;
        break;
      }
    std::string hint = "nearest world sizes that keep it:";
    if (below) hint += " " + std::to_string(below) + " (accumulation " + std::to_string(micro_batches / below) + ")";
    if (below && above) hint += " or";
    if (above) hint += " " + std::to_string(above) + " (accumulation " + std::to_string(micro_batches / above) + ")";
    hint += "; or pass keep::accumulation to scale the learning rate instead";
    return hint;
  }
};

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
    { group.size() } -> std::convertible_to<int>;
  }
batch_plan launch_plan(const batch_plan& configured, Group& group, world_change on_change = world_change::refuse,
                       std::ostream& summary_out = std::clog) {
  const int rank = static_cast<int>(group.rank());
  const int size = static_cast<int>(group.size());
  configured.validate("launch_plan");
  batch_plan plan = configured;
  if (size != configured.world) {
    if (on_change == world_change::refuse)
      throw error(rank, "launch_plan",
                  "the run was configured for world size " + std::to_string(configured.world) + " (" +
                      configured.summary() + ") but launched on " + std::to_string(size) + " ranks",
                  "launch with " + std::to_string(configured.world) +
                      " ranks, or acknowledge the change with world_change::keep_effective_batch or "
                      "world_change::keep_accumulation");
    plan = configured.rescaled_for(
        size, on_change == world_change::keep_effective_batch ? keep::effective_batch : keep::accumulation);
  }
  if (rank == 0) {
    std::string line = "cohort: " + plan.summary();
    if (size != configured.world) line += " (rescaled from world " + std::to_string(configured.world) + ")";
    if (!plan.note.empty()) line += "; " + plan.note;
    line += '\n';
    summary_out << line << std::flush;
  }
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

inline loader_workers suggest_loader_workers(int cores, int local_ranks, int requested_per_rank = -1,
                                             const warning_sink& warn = {}) {
  if (local_ranks < 1)
    throw error(-1, "suggest_loader_workers", "local_ranks must be at least 1, got " + std::to_string(local_ranks),
                "pass the process group's local_size()");
  if (cores < 1) cores = 1;
  loader_workers result;
  result.cores = cores;
  result.per_rank = requested_per_rank >= 0 ? requested_per_rank : std::max(0, cores / local_ranks - 1);
  result.total = result.per_rank * local_ranks;
  if (result.total + local_ranks > cores) {
    result.warning = std::to_string(local_ranks) + " ranks x " + std::to_string(result.per_rank) +
                     " data-loader workers + " + std::to_string(local_ranks) +
                     " training processes = " + std::to_string(result.total + local_ranks) + " busy threads on " +
                     std::to_string(cores) +
                     " cores; expect contention (suggested: " + std::to_string(std::max(0, cores / local_ranks - 1)) +
                     " workers per rank)";
    detail::emit_warning(warn, -1, result.warning);
  }
  return result;
}

inline loader_workers suggest_loader_workers_for_this_machine(int local_ranks, int requested_per_rank = -1,
                                                              const warning_sink& warn = {}) {
  return suggest_loader_workers(static_cast<int>(std::thread::hardware_concurrency()), local_ranks, requested_per_rank,
                                warn);
}

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
  batch_sequence(distributed_sampler& sampler, int per_device, int accumulation = 1,
                 partial_batch partial = partial_batch::keep)
      : sampler_(&sampler), per_device_(per_device), accumulation_(accumulation), partial_(partial) {
    if (per_device < 1 || accumulation < 1)
      throw error(sampler.rank(), "batch_sequence",
                  "per_device and accumulation must be at least 1, got " + std::to_string(per_device) + " and " +
                      std::to_string(accumulation));
  }
  batch_sequence(distributed_sampler& sampler, const batch_plan& plan, partial_batch partial = partial_batch::keep)
      : batch_sequence(sampler, plan.per_device, plan.accumulation, partial) {
    if (plan.world != sampler.world_size())
      throw error(sampler.rank(), "batch_sequence",
                  "the plan is for world " + std::to_string(plan.world) + " but the sampler splits over " +
                      std::to_string(sampler.world_size()) + " ranks",
                  "build the plan with launch_plan() or rescaled_for(world)");
  }

  // Micro-batches this rank yields in the epoch.
  std::size_t size() const noexcept {
    const auto samples = sampler_->size();
    const auto full = samples / static_cast<std::uint64_t>(per_device_);
    const bool has_partial = samples % static_cast<std::uint64_t>(per_device_) != 0 && partial_ == partial_batch::keep;
    return static_cast<std::size_t>(full + (has_partial ? 1 : 0));
  }
  // Optimizer steps in the epoch (the last may be short).
  std::size_t steps() const noexcept {
    const auto a = static_cast<std::size_t>(accumulation_);
    return (size() + a - 1) / a;
  }

  micro_batch operator[](std::size_t b) const {
    micro_batch result;
    const auto count = size();
    if (b >= count)
      throw error(sampler_->rank(), "batch_sequence",
                  "micro-batch " + std::to_string(b) + " is past the epoch's " + std::to_string(count));
    const auto a = static_cast<std::size_t>(accumulation_);
    result.batch = b;
    result.step = b / a;
    result.micro_step = static_cast<int>(b % a);
    const std::size_t step_begin = result.step * a;
    result.micro_steps = static_cast<int>(std::min(a, count - step_begin));
    result.sync = result.micro_step == result.micro_steps - 1;
    result.per_device = static_cast<std::size_t>(per_device_);
    const std::uint64_t first = static_cast<std::uint64_t>(b) * static_cast<std::uint64_t>(per_device_);
    const std::uint64_t last = std::min(first + static_cast<std::uint64_t>(per_device_), sampler_->size());
    const auto map = sampler_->index_map();
    result.indices.reserve(static_cast<std::size_t>(last - first));
    for (std::uint64_t j = first; j < last; ++j) result.indices.push_back(map(j));
    return result;
  }

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
  iterator begin() {
    sampler_->begin_pass();
    return iterator(this, 0);
  }
  iterator end() const { return iterator(this, size()); }

 private:
  distributed_sampler* sampler_;
  int per_device_;
  int accumulation_;
  partial_batch partial_;
};

}  // namespace cohort::inline v0
