#pragma once
// training_state's reproducible mode (training_options::reproducible, docs/design.md
// "Reproducible training"): the pieces that do not depend on the state's template arguments,
// compiled once (impl/reproducible.ipp) rather than in every trainer's instantiation.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cohort/comm/detail/exact_squares.hpp"
#include "cohort/config.hpp"
#include "cohort/types.hpp"

namespace cohort::inline v0::detail {

// Why `micro_batches` over `ranks` ranks (the group's size times its replicas') cannot give the
// bits of one rank, or empty: each rank must hold a run of 2^j micro-batches (M divisible by
// the ranks, M / ranks a power of two), unless one rank sums them all; with replicas the
// group's ranks must be a power of two too (the group's partial is one node of the tree).
COHORT_DECL std::string reproducible_refusal(std::size_t micro_batches, std::size_t group_size, std::size_t replicas);

// Every rank's micro-steps this step (one entry per rank), against the rule's `expected`:
// empty when all match, else the refusal naming each rank that differs.
COHORT_DECL std::string micro_step_disagreement(std::span<const std::int64_t> micro_steps, std::size_t expected,
                                                std::size_t micro_batches);

// The finite squares that add_exact_squares' bins of `type` hold, as one integer in units of
// bin 0's, 32-bit digits from the lowest, without leading zeros: the same whatever cut and order
// filled the bins (their words need not be: a sum's pieces fall where its run cut it).
COHORT_DECL std::vector<std::uint32_t> exact_squares_total(std::span<const std::int64_t> words, dtype type);
// Throws std::invalid_argument unless `words` holds `type`'s bins (a floating type's, all of them):
// exact_squares_total and exact_norm check it, since short or foreign words would read as 0.
COHORT_DECL void check_exact_squares_words(std::span<const std::int64_t> words, dtype type);

// The global norm from the ranks' summed exact squares (add_exact_squares' bins of `type`,
// comm/detail/exact_squares.hpp): the bins made one integer, rounded once to 53 bits (to nearest,
// ties to even) and its square root taken, so the same bins give the same bits anywhere and
// no sum overflows (double's squares reach 2^2048); NaN with the count of infs and NaNs, if any.
struct exact_norm_result {
  double norm = 0;
  std::int64_t nonfinite = 0;
};
COHORT_DECL exact_norm_result exact_norm(std::span<const std::int64_t> words, dtype type);

}  // namespace cohort::inline v0::detail

#if !defined(COHORT_SEPARATE_COMPILATION)
#include "cohort/parallel/impl/reproducible.ipp"
#endif
