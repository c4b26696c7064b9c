#pragma once
// cohort/data/batch.hpp's definitions: inline there when header-only, compiled once by <cohort/src.hpp>
// under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <iostream>
#include <iterator>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <vector>
#include "cohort/data/sampler.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"

#include "cohort/config.hpp"
#include "cohort/data/batch.hpp"

namespace cohort::inline v0 {

COHORT_DECL loader_workers suggest_loader_workers(int cores, int local_ranks, int requested_per_rank,
                                                  const warning_sink& warn) {
  if (local_ranks < 1)
    throw error(-1, "suggest_loader_workers",
                detail::text("local_ranks must be at least 1, got ", std::to_string(local_ranks)),
                "pass the process group's local_size()");
  if (cores < 1) cores = 1;
  loader_workers result;
  result.cores = cores;
  result.per_rank = requested_per_rank >= 0 ? requested_per_rank : std::max(0, cores / local_ranks - 1);
  result.total = result.per_rank * local_ranks;
  if (result.total + local_ranks > cores) {
    result.warning = detail::text(std::to_string(local_ranks), " ranks x ", std::to_string(result.per_rank),
                                  " data-loader workers + ", std::to_string(local_ranks),
                                  " training processes = ", std::to_string(result.total + local_ranks),
                                  " busy threads on ", std::to_string(cores), " cores; expect contention (suggested: ",
                                  std::to_string(std::max(0, cores / local_ranks - 1)), " workers per rank)");
    detail::emit_warning(warn, -1, result.warning);
  }
  return result;
}

COHORT_DECL loader_workers suggest_loader_workers_for_this_machine(int local_ranks, int requested_per_rank,
                                                                   const warning_sink& warn) {
  return suggest_loader_workers(static_cast<int>(std::thread::hardware_concurrency()), local_ranks, requested_per_rank,
                                warn);
}

}  // namespace cohort::inline v0

namespace cohort::inline v0 {

COHORT_DECL auto batch_plan::rescaled_for(int new_world, keep what) const -> batch_plan {
  validate("batch_plan::rescaled_for");
  if (new_world < 1)
    throw error(-1, "batch_plan::rescaled_for",
                detail::text("new world size must be at least 1, got ", std::to_string(new_world)));
  batch_plan result = *this;
  result.world = new_world;
  result.note.clear();
  if (what == keep::effective_batch) {
    const std::int64_t micro_batches = std::int64_t{accumulation} * world;  // per step, all ranks
    if (micro_batches % new_world != 0) {
      throw error(
          -1, "batch_plan::rescaled_for",
          detail::text("cannot keep effective batch ", std::to_string(effective()), " (per_device ",
                       std::to_string(per_device), " x accumulation ", std::to_string(accumulation), " x world ",
                       std::to_string(world), ") on world ", std::to_string(new_world), ": accumulation would be ",
                       std::to_string(micro_batches), "/", std::to_string(new_world), ", not a whole number"),
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

COHORT_DECL auto batch_plan::summary() const -> std::string {
  std::ostringstream line;
  line << "per-device batch " << per_device << " x accumulation " << accumulation << " x world " << world
       << " = effective batch " << effective();
  if (learning_rate != 0.0) line << ", learning rate " << learning_rate;
  return line.str();
}

COHORT_DECL auto batch_plan::validate(const char* operation) const -> void {
  if (per_device < 1 || accumulation < 1 || world < 1)
    throw error(
        -1, operation,
        detail::text("per_device, accumulation and world must all be at least 1, got ", std::to_string(per_device),
                     ", ", std::to_string(accumulation), ", ", std::to_string(world)));
}

COHORT_DECL auto batch_plan::nearest_worlds_hint(std::int64_t micro_batches, int new_world) -> std::string {
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
  if (below)
    hint += detail::text(" ", std::to_string(below), " (accumulation ", std::to_string(micro_batches / below), ")");
  if (below && above) hint += " or";
  if (above)
    hint += detail::text(" ", std::to_string(above), " (accumulation ", std::to_string(micro_batches / above), ")");
  hint += "; or pass keep::accumulation to scale the learning rate instead";
  return hint;
}
COHORT_DECL auto global_batch::plan_for(int world) const -> batch_plan {
  if (size < 1 || accumulation < 1 || world < 1)
    throw error(-1, "global_batch::plan_for",
                detail::text("global batch size, accumulation and world must all be at least 1, got ",
                             std::to_string(size), ", ", std::to_string(accumulation), ", ", std::to_string(world)));
  const std::int64_t micro_batches = std::int64_t{world} * accumulation;  // per step, all ranks
  const std::int64_t per_device = size / micro_batches;
  if (size % micro_batches != 0) {
    std::ostringstream detail;
    detail << "global batch " << size << " does not split over world " << world << " x accumulation " << accumulation
           << " = " << micro_batches << " micro-batches per step: the per-device batch would be " << size << "/"
           << micro_batches << " = " << static_cast<double>(size) / static_cast<double>(micro_batches)
           << (per_device == 0 ? ", less than one" : "");
    std::ostringstream hint;
    hint << "nearest global batches that split: ";
    if (per_device > 0) hint << per_device * micro_batches << " (per-device batch " << per_device << ") or ";
    hint << (per_device + 1) * micro_batches << " (per-device batch " << per_device + 1 << ")";
    if (size % world == 0) {
      // The accumulations that split this global batch on this world: divisors of its share per rank.
      const std::int64_t per_rank = size / world;
      std::int64_t below = 0, above = 0;
      for (std::int64_t d = 1; d <= per_rank / d; ++d) {
        if (per_rank % d != 0) continue;
        for (const std::int64_t divisor : {d, per_rank / d}) {
          if (divisor < accumulation && divisor > below) below = divisor;
          if (divisor > accumulation && (above == 0 || divisor < above)) above = divisor;
        }
      }
      hint << "; or keep global batch " << size << " with accumulation ";
      if (below) hint << below << " (per-device batch " << per_rank / below << ")";
      if (below && above) hint << " or ";
      if (above) hint << above << " (per-device batch " << per_rank / above << ")";
    }
    throw error(-1, "global_batch::plan_for", detail.str(), hint.str());
  }
  if (per_device > std::numeric_limits<int>::max())
    throw error(-1, "global_batch::plan_for",
                detail::text("global batch ", std::to_string(size), " gives a per-device batch of ",
                             std::to_string(per_device), ", past the largest int"),
                "raise the accumulation");
  return batch_plan{.per_device = static_cast<int>(per_device),
                    .accumulation = accumulation,
                    .world = world,
                    .learning_rate = learning_rate};
}

namespace detail {

COHORT_DECL void check_same_global_batch(const global_batch& mine, const std::vector<double>& extremes, int rank) {
  // extremes: the maxima of size, accumulation, learning rate, then of their negations.
  const auto differs = [&](std::size_t i) { return extremes[i] != -extremes[i + 3]; };
  if (!differs(0) && !differs(1) && !differs(2)) return;
  std::ostringstream detail;
  detail << "the ranks were configured with different global batches: this rank has global batch " << mine.size
         << ", accumulation " << mine.accumulation;
  if (mine.learning_rate != 0.0 || differs(2)) detail << ", learning rate " << mine.learning_rate;
  detail << "; across the ranks";
  const char* names[] = {"global batch", "accumulation", "learning rate"};
  const char* separator = " ";
  for (std::size_t i = 0; i < 3; ++i) {
    if (!differs(i)) continue;
    detail << separator << names[i] << " ranges ";
    if (i < 2)  // counts: exact in a double, printed whole
      detail << static_cast<std::int64_t>(-extremes[i + 3]) << ".." << static_cast<std::int64_t>(extremes[i]);
    else
      detail << -extremes[i + 3] << ".." << extremes[i];
    separator = ", ";
  }
  throw error(rank, "launch_plan", detail.str(),
              "every rank must read the same configuration: compare the ranks' command lines, environment and "
              "config files");
}

}  // namespace detail

COHORT_DECL batch_sequence::batch_sequence(distributed_sampler& sampler, int per_device, int accumulation,
                                           partial_batch partial)
    : sampler_(&sampler), per_device_(per_device), accumulation_(accumulation), partial_(partial) {
  if (per_device < 1 || accumulation < 1)
    throw error(sampler.rank(), "batch_sequence",
                detail::text("per_device and accumulation must be at least 1, got ", std::to_string(per_device),
                             " and ", std::to_string(accumulation)));
  // A sampler in micro-batch mode holds runs of whole micro-batches: a sequence cut otherwise
  // would mix micro-batches, or steps, in one micro-step.
  const std::uint64_t run = sampler.micro_batches_per_rank(), size = sampler.options().micro_batch_size;
  if (run != 0 && (static_cast<std::uint64_t>(per_device) != size || static_cast<std::uint64_t>(accumulation) != run))
    throw error(sampler.rank(), "batch_sequence",
                detail::text("the sampler gives this rank ", std::to_string(run), " micro-batches of ",
                             std::to_string(size), " samples per step, but the sequence was asked for per_device ",
                             std::to_string(per_device), " and accumulation ", std::to_string(accumulation)),
                "pass per_device = micro_batch_size and accumulation = micro_batches / world");
}

COHORT_DECL batch_sequence::batch_sequence(distributed_sampler& sampler, const batch_plan& plan, partial_batch partial)
    : batch_sequence(sampler, plan.per_device, plan.accumulation, partial) {
  if (plan.world != sampler.world_size())
    throw error(sampler.rank(), "batch_sequence",
                detail::text("the plan is for world ", std::to_string(plan.world), " but the sampler splits over ",
                             std::to_string(sampler.world_size()), " ranks"),
                "build the plan with launch_plan() or rescaled_for(world)");
}

COHORT_DECL auto batch_sequence::size() const noexcept -> std::size_t {
  const auto samples = sampler_->size();
  const auto full = samples / static_cast<std::uint64_t>(per_device_);
  const bool has_partial = samples % static_cast<std::uint64_t>(per_device_) != 0 && partial_ == partial_batch::keep;
  return static_cast<std::size_t>(full + (has_partial ? 1 : 0));
}

COHORT_DECL auto batch_sequence::steps() const noexcept -> std::size_t {
  const auto a = static_cast<std::size_t>(accumulation_);
  return (size() + a - 1) / a;
}

COHORT_DECL auto batch_sequence::operator[](std::size_t b) const -> micro_batch {
  micro_batch result;
  const auto count = size();
  if (b >= count)
    throw error(sampler_->rank(), "batch_sequence",
                detail::text("micro-batch ", std::to_string(b), " is past the epoch's ", std::to_string(count)));
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

COHORT_DECL auto batch_sequence::begin() -> iterator {
  sampler_->begin_pass();
  return iterator(this, 0);
}

}  // namespace cohort::inline v0
