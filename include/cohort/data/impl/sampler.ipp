#pragma once
// cohort/data/sampler.hpp's definitions: inline there when header-only, compiled once by <cohort/src.hpp>
// under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iostream>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>
#include "cohort/data/detail/permutation.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"

#include "cohort/config.hpp"
#include "cohort/data/sampler.hpp"

namespace cohort::inline v0 {
namespace detail {

COHORT_DECL void emit_warning(const warning_sink& sink, int rank, std::string_view message) {
  std::string line = "cohort";
  if (rank >= 0) line += detail::text(" [rank ", std::to_string(rank), "]");
  line += " warning: ";
  line += message;
  if (sink) {
    sink(line);
  } else {
    line += '\n';
    std::cerr << line << std::flush;  // one write per line keeps ranks' lines whole
  }
}

}  // namespace detail
}  // namespace cohort::inline v0

namespace cohort::inline v0 {

COHORT_DECL distributed_sampler::distributed_sampler(std::uint64_t dataset_size, int world, int rank,
                                                     sampler_options options)
    : dataset_size_(dataset_size), world_(world), rank_(rank), options_(std::move(options)) {
  if (world < 1)
    throw error(rank, "distributed_sampler", detail::text("world size must be at least 1, got ", std::to_string(world)),
                "pass the process group's size()");
  if (rank < 0 || rank >= world)
    throw error(rank, "distributed_sampler",
                detail::text("rank ", std::to_string(rank), " is outside [0, ", std::to_string(world), ")"),
                "pass the process group's rank(), not its local rank");
  const auto w = static_cast<std::uint64_t>(world);
  const auto r = static_cast<std::uint64_t>(rank);
  const std::uint64_t micro_batches = options_.micro_batches, micro_batch_size = options_.micro_batch_size;
  if ((micro_batches == 0) != (micro_batch_size == 0))
    throw error(rank, "distributed_sampler",
                detail::text("micro-batch mode needs both micro_batches and micro_batch_size, got ",
                             std::to_string(micro_batches), " and ", std::to_string(micro_batch_size)),
                "set both (a global step of micro_batches x micro_batch_size samples), or neither");
  if (micro_batches != 0) {
    if (micro_batches % w != 0)
      throw error(rank, "distributed_sampler",
                  detail::text("micro-batch mode: ", std::to_string(micro_batches), " micro-batches per step over ",
                               std::to_string(world),
                               " ranks: each rank reads a contiguous run of micro_batches / "
                               "world of them, so micro_batches must be a multiple of the world size"),
                  "keep micro_batches (the same at every world size) and run on a world size that divides it");
    if (!options_.even_batches && !options_.drop_last)
      throw error(rank, "distributed_sampler",
                  "micro-batch mode with even_batches = false: every rank reads whole runs of micro-batches",
                  "leave even_batches on (the tail is padded) or set drop_last");
    run_ = micro_batches / w * micro_batch_size;
    round_ = micro_batches * micro_batch_size;
  } else {
    round_ = w;  // torch's interleaving: one position per rank per round
  }
  const std::uint64_t whole_rounds = dataset_size / round_;
  const std::uint64_t remainder = dataset_size % round_;
  if (options_.drop_last) {
    samples_per_rank_ = whole_rounds * run_;  // torch: ceil((n - w) / w); the tail is dropped, nothing padded
    total_size_ = whole_rounds * round_;
  } else if (options_.even_batches) {
    samples_per_rank_ = (whole_rounds + (remainder != 0 ? 1 : 0)) * run_;
    total_size_ = samples_per_rank_ * w;
  } else {
    // Positions r, r + w, ... below n: one more for the ranks below the remainder.
    samples_per_rank_ = whole_rounds + (r < remainder ? 1 : 0);
    total_size_ = dataset_size;
  }
  // Real samples sit at the positions below n (below total_size with drop_last, which pads
  // nothing): this rank's run in each whole round below that bound, and the part of its run
  // below it in the round the bound cuts.
  const std::uint64_t real_positions = std::min(total_size_, dataset_size);
  const std::uint64_t cut = real_positions % round_, run_begin = r * run_;
  unpadded_size_ = real_positions / round_ * run_ + (cut > run_begin ? std::min(cut - run_begin, run_) : 0);
}

COHORT_DECL auto distributed_sampler::set_epoch(std::uint64_t epoch) noexcept -> void {
  epoch_ = epoch;
  passes_this_epoch_ = 0;
}

COHORT_DECL auto distributed_sampler::at(std::uint64_t j) const -> std::uint64_t {
  if (j >= samples_per_rank_)
    throw error(rank_, "distributed_sampler::at",
                detail::text("position ", std::to_string(j), " is past this rank's ", std::to_string(samples_per_rank_),
                             " samples"));
  return (*this)[j];
}

COHORT_DECL auto distributed_sampler::index_map() const noexcept -> detail::rank_index_map {
  detail::rank_index_map map;
  map.permutation = detail::feistel_permutation(dataset_size_, options_.seed, epoch_);
  map.dataset_size = dataset_size_;
  map.samples_per_rank = samples_per_rank_;
  map.run = run_;
  map.round = round_;
  map.rank = static_cast<std::uint64_t>(rank_);
  map.shuffle = options_.shuffle;
  return map;
}

COHORT_DECL auto distributed_sampler::begin_pass() -> void {
  ++passes_this_epoch_;
  if (options_.shuffle && passes_this_epoch_ == 2 && !warned_same_order_) {
    warned_same_order_ = true;
    detail::emit_warning(
        options_.warn, rank_,
        detail::text("distributed_sampler: a new pass over the data started with shuffle on but without "
                     "set_epoch(); it repeats epoch ",
                     std::to_string(epoch_),
                     "'s order exactly. Call sampler.set_epoch(epoch) at the start of every epoch."));
  }
}

COHORT_DECL auto distributed_sampler::indices() -> std::vector<std::uint64_t> {
  begin_pass();
  std::vector<std::uint64_t> out(static_cast<std::size_t>(samples_per_rank_));
  const auto map = index_map();
  for (std::uint64_t j = 0; j < samples_per_rank_; ++j) out[static_cast<std::size_t>(j)] = map(j);
  return out;
}

COHORT_DECL auto distributed_sampler::begin() -> iterator {
  begin_pass();
  return iterator(index_map(), 0);
}

}  // namespace cohort::inline v0
